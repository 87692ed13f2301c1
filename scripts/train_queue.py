"""A queue of training jobs over this machine's GPUs: `python scripts/train_queue.py add|list|cancel|move|pause|resume|log|run`.

Jobs start as their GPUs free up, several at once on separate GPUs, and run detached: closing the terminal or
the GUI stops none of them. `--host user@box` works on a remote machine's queue. See docs/Queue.md.
(Not `scripts/queue.py`: a file of that name here would hide Python's own `queue` module from every script in
this folder - torch imports it.)
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from modules.queue.cli import script_main
    sys.exit(script_main())
