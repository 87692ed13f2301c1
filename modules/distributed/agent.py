"""torchrun (`torch.distributed.run`) as Tandem's launcher runs it, plus a note of how each failed worker ended.

torchrun reports a failure as a table on stderr whose "root cause" is the earliest failure by whole
seconds - among ranks that failed in the same second, the lowest rank, typically rank 0's "Connection
reset by peer" when rank 1 was killed. To name the rank that failed first, the launcher needs every
failed rank's exit code: this notes them (JSON) in the file named by `EXITS_VARIABLE`, for every failed
round of workers - the rounds that torchrun's agent restarts (`--max_restarts`) too, so that a restarted
rank 0 can say what ended the round before. torchrun's own log (rounds, stopped workers, its failure table)
goes to a file beside the exits file (`agent.log`), not above the launcher's one-line headline.

A node that never joins the rendezvous makes the agent give up after its join timeout; that is noted
in the same file (`{"rendezvous": "timeout"}`), so the launcher can name it instead of a traceback.

    python -m modules.distributed.agent <torchrun arguments>
"""
from __future__ import annotations

import json
import os
import sys
import time

from modules.distributed.failures import ENDED_BY_WATCHDOG

EXITS_VARIABLE = "TANDEM_WORKER_EXITS"
ROUND_VARIABLE = "TANDEM_RENDEZVOUS_ROUND"
"""The workers' rendezvous round (the same on every machine; a new one after each restart)."""


def _note(entries: list[dict]) -> None:
    """Append `entries` to the exits file (one agent per machine writes it)."""
    target = os.environ.get(EXITS_VARIABLE)
    if not target:
        return
    from modules.util.atomic import write_text_atomically
    try:
        known = json.loads(open(target, encoding="utf-8").read())
    except (OSError, ValueError):
        known = []
    write_text_atomically(target, json.dumps(known + entries))


def _note_failed_rounds() -> None:
    """Wrap the agent's monitoring so that each failed round's exits are noted before it restarts or gives up."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers
    if getattr(monitor, "tandem_notes", False):
        return

    def monitor_and_note(self, worker_group):
        result = monitor(self, worker_group)
        if result.is_failed():
            attempt = worker_group.spec.max_restarts - self._remaining_restarts
            _note([{"attempt": attempt, "rank": rank, "exitcode": failure.exitcode,
                    "seen_at": failure.timestamp or time.time()} for rank, failure in result.failures.items()])
            # A watchdog ended a worker because of another: the healthy ones leave by themselves, the one it
            # named is frozen or stuck, and SIGTERM's grace would only delay the restart.
            global _grace_s
            _grace_s = WATCHDOG_GRACE_S if any(f.exitcode == ENDED_BY_WATCHDOG for f in result.failures.values()) \
                else TERMINATE_GRACE_S
        return result

    monitor_and_note.tandem_notes = True
    LocalElasticAgent._monitor_workers = monitor_and_note


def _share_the_round() -> None:
    """Give the workers the rendezvous round they belong to (`ROUND_VARIABLE`).

    Restarted workers meet in the same store as the round before; the keys the dead round left there
    (gloo's addresses, barriers) would mislead them, so each round's keys live under its own prefix. The
    round number is the same on every machine (the rendezvous counts it), which a restart count is not:
    an agent whose workers were healthy restarts them without counting it."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    join = DynamicRendezvousHandler.next_rendezvous
    if getattr(join, "tandem_round", False):
        return

    def join_and_share_round(self):
        info = join(self)
        state = getattr(getattr(self, "_state_holder", None), "state", None)
        os.environ[ROUND_VARIABLE] = str(getattr(state, "round", None) or os.environ.get(ROUND_VARIABLE, "0"))
        return info

    join_and_share_round.tandem_round = True
    DynamicRendezvousHandler.next_rendezvous = join_and_share_round


TERMINATE_GRACE_S = 10
"""How long torchrun's agent lets a worker end after SIGTERM before it kills it (torchrun's own: 30 s). A hung
worker - the usual reason to end one - never ends by itself, so its grace only delays the restart; Tandem's
workers act on SIGTERM at their next step. The same as the spawn launcher's (`supervision.TERMINATE_GRACE_S`)."""
WATCHDOG_GRACE_S = 3
"""The grace when a worker's watchdog ended it because of another (see `monitor_and_note`): the healthy ones
leave by themselves within a beat or two, the one it named is frozen or stuck."""
_grace_s = TERMINATE_GRACE_S
"""The grace of the round being stopped (decided by `monitor_and_note`)."""


def _shorter_grace() -> None:
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = PContext.close
    if getattr(close, "tandem_grace", False):
        return

    def close_sooner(self, death_sig=None, timeout: int = TERMINATE_GRACE_S) -> None:
        close(self, death_sig, min(timeout, _grace_s))

    close_sooner.tandem_grace = True
    PContext.close = close_sooner


def _log_to_file() -> None:
    """torchrun's own log (rendezvous rounds, stopped and restarted workers, its failure table) goes to a file
    beside the exits file, not above the launcher's one-line headline."""
    import logging
    target = os.environ.get(EXITS_VARIABLE)
    if not target:
        return
    name = os.path.basename(target).replace("worker-exits", "agent").rsplit(".", 1)[0] + ".log"
    try:
        handler = logging.FileHandler(os.path.join(os.path.dirname(target), name), encoding="utf-8")
    except OSError:
        return
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for logger_name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        logger = logging.getLogger(logger_name)
        logger.handlers = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import parse_args, run

    _note_failed_rounds()
    _share_the_round()
    _shorter_grace()
    _log_to_file()
    try:
        run(parse_args(argv))  # not torchrun's `main`: its error handler prints the failure table and a traceback
    except ChildFailedError as error:
        logging_of_failure(error)
        sys.exit(1)  # the launcher names the rank that failed first, from the notes
    except RendezvousTimeoutError:
        _note([{"rendezvous": "timeout", "seen_at": time.time()}])
        sys.exit(1)


def logging_of_failure(error: BaseException) -> None:
    import logging
    logging.getLogger("torch.distributed.elastic").error("the workers failed:\n%s", error)


if __name__ == "__main__":
    main()
