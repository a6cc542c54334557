"""Trains the model corpus (tests/models/corpus.py) as one task of a cluster.

    python corpus_fit.py multi_worker OUTDIR CASE[:SETTING] ...   # one task of tfdist launch
    python corpus_fit.py ps OUTDIR CASE ...   # chief of a local 2-worker, 1-ps cluster

Each case is trained with the same global batches and seed as the in-process
one-device reference. Saves each case's weights to
OUTDIR/<task>-<case>-<setting>.npz and prints one "tfdist result:" line with
the losses.
"""

from __future__ import annotations

import json
import os
import sys

from protocol import say

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "models"))

import numpy as np

import corpus
import tfdist

MODE, OUT, WANTED = sys.argv[1], sys.argv[2], sys.argv[3:]
#: Asynchronous updates are noisy, and under SGD BERT stays near chance for
#: many steps: its third epoch rose above the first (1.079, 1.043, 1.138).
#: The parameter-server runs use Adam, which moves BERT clearly in 4 epochs.
PS_EPOCHS = 4

if MODE == "ps":
    cluster = tfdist.local_cluster(workers=2, ps=1, log_dir=os.path.join(OUT, "logs"))
    task = "chief"
    make = lambda setting: tfdist.strategy_from_config(cluster.tf_config)  # noqa: E731
else:
    task = "worker{}".format(json.loads(os.environ["TF_CONFIG"])["task"]["index"])
    made = {}

    def make(setting):
        # One strategy per setting, shared by the cases (each later
        # strategy re-creates the collectives, in step on every worker).
        if setting not in made:
            made[setting] = tfdist.strategy_from_config(compression=setting, register_timeout=90)
        return made[setting]


result = {"task": task, "cases": {}}
for wanted in WANTED:
    name, _, setting = wanted.partition(":")
    entry = corpus.CASES[name]
    strategy = make(setting or None)
    if MODE == "ps":  # model.fit runs tfdist.fit under ParameterServerStrategy.
        run = corpus.train(entry, strategy, epochs=PS_EPOCHS, optimizer="adam")
    else:
        run = (
            corpus.train(entry, strategy, **corpus.exact_run(entry))
            if entry.exact_steps and not setting
            else corpus.train(entry, strategy, epochs=3)
        )
    key = f"{name}-{setting or 'none'}"
    np.savez(os.path.join(OUT, f"{task}-{key}.npz"), *run["weights"])
    result["cases"][key] = {
        "losses": run["losses"],
        "epochs": run["epochs"],
        "trainable": run["trainable"],
    }
say("tfdist result: " + json.dumps(result))
