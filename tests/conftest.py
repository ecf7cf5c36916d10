import os
import sys
from pathlib import Path

# Every torch process a test starts gets one intra-op thread: 8 ranks on 2 cores
# otherwise oversubscribe the machine by 8x and crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
