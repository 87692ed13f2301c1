"""Start the Tandem GUI: `python scripts/train_ui.py` (or start-ui.sh / start-ui.bat)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modules.util.bytecode import keep_bytecode  # noqa: E402
from modules.util.compile_cache import keep_compile_cache  # noqa: E402

keep_bytecode()  # before torch is imported: see modules/util/bytecode.py
keep_compile_cache()  # before diffusers is imported (training runs in workers of this process)

from ui.views.app import TandemApp  # noqa: E402


def main() -> None:
    TandemApp().mainloop()


if __name__ == "__main__":
    main()
