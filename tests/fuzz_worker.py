"""Reads damaged bundles one by one, as replay would, and says how each ended (tests/test_fuzz.py).

    python -m tests.fuzz_worker FILE...

Per file: ``START name``, then ``OK name`` (read fine), ``REFUSED name ErrorClass`` (a ParityError:
the expected outcome for damage) or ``BAD name ErrorClass: message`` (any other exception).
"""

from __future__ import annotations

import faulthandler
import sys
from pathlib import Path

from parity_harness.common.errors import ParityError
from parity_harness.replay.reader import BundleReader


def read_like_replay(path: Path) -> None:
    with BundleReader(path, preflight=5.0) as reader:
        reader.rebuild(reader.index.inputs)
        for ref in reader.index.tensor_refs():
            if reader.summary(ref) is None:
                reader.read_tensor(ref)
        reader.provenance()


def main() -> None:
    for name in sys.argv[1:]:
        path = Path(name)
        print(f"START {path.name}", flush=True)
        faulthandler.dump_traceback_later(15, exit=True)  # a hang prints where it hangs, then ends the worker
        try:
            read_like_replay(path)
        except ParityError as err:
            print(f"REFUSED {path.name} {type(err).__name__}", flush=True)
        except Exception as err:
            message = str(err).replace("\n", " ")[:200]
            print(f"BAD {path.name} {type(err).__name__}: {message}", flush=True)
        else:
            print(f"OK {path.name}", flush=True)
        faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
