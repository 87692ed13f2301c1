"""The interactive multi-GPU launcher behind start-multi-gpu.bat (see modules/start_multi_gpu.py).

    python scripts/start_multi_gpu.py [--yes] [--config X] [--num-gpus N] ... [--dry-run]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from modules.start_multi_gpu import main
    sys.exit(main())
