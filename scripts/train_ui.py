"""Start the Tandem GUI: `python scripts/train_ui.py` (or start-ui.sh / start-ui.bat)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from modules.util.bytecode import keep_bytecode  # noqa: E402

keep_bytecode()  # before torch is imported: see modules/util/bytecode.py

from ui.views.app import TandemApp  # noqa: E402


def main() -> None:
    TandemApp().mainloop()


if __name__ == "__main__":
    main()
