"""Render a PNG of every GUI tab into docs/images/ (for docs/GUI.md).

    python scripts/render_screenshots.py [--out docs/images] [--example-gpus 2]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ui.screenshots import main  # noqa: E402

if __name__ == "__main__":
    main()
