"""Write captions for a concept folder's images from a local image-to-text model (nothing is downloaded).

    python scripts/caption.py --model DIR --folder DIR [--overwrite] [--prefix "sks"] [--num-gpus N]

Images that have a caption file keep it unless --overwrite; each process captions its share of the images on
its own GPU (modules/model/captioner.py).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from modules.model.captioner import main
    sys.exit(main())
