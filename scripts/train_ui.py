"""Start the Tandem GUI: `python scripts/train_ui.py` (or start-ui.sh / start-ui.bat).

Without a display (no $DISPLAY, or an X server that cannot be reached: an SSH session, a container) it
says so in one line, names what works without one, and exits with status 2, before building the window.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modules.util.bytecode import keep_bytecode  # noqa: E402
from modules.util.compile_cache import keep_compile_cache  # noqa: E402

keep_bytecode()  # before torch is imported: see modules/util/bytecode.py
keep_compile_cache()  # before diffusers is imported (training runs in workers of this process)

INSTEAD = ("without a window: ./start-multi-gpu.sh (asks for the config and GPUs), "
           ".venv/bin/python scripts/train.py --config-path my.json, or a remote machine with "
           "scripts/train_remote.py --host user@gpu-box --config-path my.json")


def display_problem() -> str | None:
    """Why no window can open here, in one line, or None. Opens (and closes) a Tk root: the only sure test
    of an X server that $DISPLAY names, and a few milliseconds where there is one."""
    import os

    try:
        import tkinter
    except ImportError as e:  # Python built without Tk, or Debian's python3-tk missing
        return f"Python's Tk is missing ({e}); install it (Debian/Ubuntu: apt install python3-tk)"
    try:
        root = tkinter.Tk()
    except tkinter.TclError as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        display = os.environ.get("DISPLAY", "")
        if "display" not in message.lower():
            return f"the window cannot open: {message}"
        if not display:
            return "no display: $DISPLAY is not set (an SSH session without -X, a container or a server)"
        return f"no display: the X server at DISPLAY={display} cannot be reached ({message})"
    root.destroy()
    return None


def main() -> int:
    problem = display_problem()
    if problem:
        print(f"train_ui.py: {problem}; {INSTEAD}.", file=sys.stderr, flush=True)
        return 2
    from ui.views.app import TandemApp

    TandemApp().mainloop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
