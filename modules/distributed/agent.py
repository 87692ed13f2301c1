"""torchrun (`torch.distributed.run`) as Tandem's launcher runs it, plus a note of how each failed worker ended.

torchrun reports a failure as a table on stderr whose "root cause" is the earliest failure by whole
seconds - among ranks that failed in the same second, the lowest rank, typically rank 0's "Connection
reset by peer" when rank 1 was killed. To name the rank that failed first, the launcher needs every
failed rank's exit code: this notes them (JSON) in the file named by `EXITS_VARIABLE`, for every failed
round of workers - the rounds that torchrun's agent restarts (`--max_restarts`) too, so that a restarted
rank 0 can say what ended the round before - then lets torchrun's own error and report through unchanged.

A node that never joins the rendezvous makes the agent give up after its join timeout; that is noted
in the same file (`{"rendezvous": "timeout"}`), so the launcher can name it instead of a traceback.

    python -m modules.distributed.agent <torchrun arguments>
"""
from __future__ import annotations

import json
import os
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


WATCHDOG_GRACE_S = 3
"""The grace after a worker's watchdog ended it (see `monitor_and_note`)."""
_grace_s = 10
TERMINATE_GRACE_S = 10
"""How long torchrun's agent lets a worker end after SIGTERM before it kills it (torchrun's own: 30 s). A hung
worker - the usual reason to end one - never ends by itself, so its grace only delays the restart; Tandem's
workers act on SIGTERM at their next step. The same as the spawn launcher's (`supervision.TERMINATE_GRACE_S`)."""


def _shorter_grace() -> None:
    from torch.distributed.elastic.multiprocessing.api import PContext

    close = PContext.close
    if getattr(close, "tandem_grace", False):
        return

    def close_sooner(self, death_sig=None, timeout: int = TERMINATE_GRACE_S) -> None:
        close(self, death_sig, min(timeout, _grace_s))

    close_sooner.tandem_grace = True
    PContext.close = close_sooner


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError
    from torch.distributed.run import main as torchrun

    _note_failed_rounds()
    _share_the_round()
    _shorter_grace()
    try:
        torchrun(argv)
    except RendezvousTimeoutError:
        _note([{"rendezvous": "timeout", "seen_at": time.time()}])
        raise


if __name__ == "__main__":
    main()
