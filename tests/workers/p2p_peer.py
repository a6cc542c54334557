"""A pipeline stage in its own process, for tests/transport/test_p2p.py.

``python tests/workers/p2p_peer.py STAGE ADDRESSES`` (ADDRESSES comma-separated)
connects as stage STAGE, waits for the message tagged ``("F", 0, 0)`` from the
stage below, sends its arrays back doubled as ``("B", 0, 0)``, says one
``tfdist result:`` line with what it received, then sleeps until it is killed
(the test SIGKILLs it while the other stage waits in ``recv``), at most
LINGER_SECONDS.
"""

import sys
import time
from pathlib import Path

from protocol import result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # Run without PYTHONPATH too.
from tfdist.transport import p2p  # noqa: E402

#: A peer the test forgot to kill still ends.
LINGER_SECONDS = 60


def main() -> None:
    stage, addresses = int(sys.argv[1]), sys.argv[2].split(",")
    links = p2p.connect_stages(stage, addresses, timeout=30.0)
    below = links[stage - 1]
    arrays = below.recv(("F", 0, 0))
    below.send(("B", 0, 0), [a * 2 for a in arrays])
    result({"stage": stage, "peers": sorted(links), "sums": [float(a.sum()) for a in arrays]})
    time.sleep(LINGER_SECONDS)


if __name__ == "__main__":
    main()
