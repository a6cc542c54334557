"""What the benchmark scripts share: one copy of each piece.

* :mod:`timing`: the per-step wall-clock timer callback of ``fit``;
* :mod:`netns`: a private network namespace with a rate-limited loopback
  (root, ``unshare -n``, ``ip``, ``tc``), and re-running a script inside one;
* :mod:`mlp`: the MLP, its initial weights and the synthetic data that both
  frameworks train in the slow-network and profiling benchmarks;
* :mod:`torch_peer`: one rank of the PyTorch DDP peer (optional: torch).

The scripts import it as ``benchlib`` with ``benchmarks/`` on ``sys.path``
(each script puts it there), so that they also run as
``python benchmarks/X.py`` and as the subprocesses they start.
"""
