"""``--mask-padding``: leave positions past each example's recorded length out of the comparison.

Batches of unequal lengths are padded, and a port may leave anything in the padding. Which positions of a record
are padded is decided by the bundle's :class:`~parity_harness.common.format.bundle.lengths.PaddingPlan`, the one
capture zeroed the cotangent of the model's outputs by, read here from the bundle's records. The lengths are the
*reference's*, so the port cannot move the boundary.
"""

from __future__ import annotations

import numpy as np

from parity_harness.common.format.bundle.lengths import PaddingPlan
from parity_harness.common.format.bundle.schema import TensorRef
from parity_harness.replay.reader import BundleReader

__all__ = ["PaddingPlan", "padding_plan"]


def padding_plan(reader: BundleReader) -> PaddingPlan:
    """Where the reference's batch is padded, for every record of the bundle."""
    index = reader.index

    def values(ref: TensorRef) -> np.ndarray | None:
        return None if reader.summary(ref) is not None else reader.read_array(ref)

    return PaddingPlan(index.run.lengths, index.forward_order, index.calls, index.inputs, index.outputs, values)
