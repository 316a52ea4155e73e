"""Observing a model without changing its numbers: module hooks, slot naming and how one run is driven."""
