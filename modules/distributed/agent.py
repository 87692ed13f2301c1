"""torchrun (`torch.distributed.run`) as Tandem's launcher runs it, plus a note of how each failed worker ended.

torchrun reports a failure as a table on stderr whose "root cause" is the earliest failure by whole
seconds - among ranks that failed in the same second, the lowest rank, typically rank 0's "Connection
reset by peer" when rank 1 was killed. To name the rank that failed first, the launcher needs every
failed rank's exit code: this writes them (JSON) to the file named by `EXITS_VARIABLE`, then lets
torchrun's own error and report through unchanged.

    python -m modules.distributed.agent <torchrun arguments>
"""
from __future__ import annotations

import json
import os

EXITS_VARIABLE = "TANDEM_WORKER_EXITS"


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as e:
        target = os.environ.get(EXITS_VARIABLE)
        if target:
            from modules.util.atomic import write_text_atomically
            exits = [{"rank": rank, "exitcode": failure.exitcode, "seen_at": failure.timestamp}
                     for rank, failure in e.failures.items()]
            write_text_atomically(target, json.dumps(exits))
        raise


if __name__ == "__main__":
    main()
