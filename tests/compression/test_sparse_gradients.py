"""Sparse gradients (an Embedding table's IndexedSlices): what is sent, and
that predicted bytes equal the bytes really sent, at every setting.

TensorFlow all-gathers an IndexedSlices (each replica's row count, then its
values and indices, padded to the fullest replica's rows); it does not
all-reduce the table. Here the prediction (predict_traffic, from the model
and the batch size), the recording of the real collectives (Comm) and the
fit callback (CommunicationStats) are compared, with 1 and 2 replicas.
"""

from __future__ import annotations

import numpy as np
import pytest

import tfdist
from tfdist.compression import PowerSGD, make_aggregator, predict_traffic
from tfdist.compression.aggregate import Item
from tfdist.compression.auto import AutoCompression, LinkEstimate
from tfdist.record import record_of
from tfdist.transport.comm import LocalComm, ReplicaComm

pytestmark = pytest.mark.usefixtures("tf_cpus")

VOCAB, DIM, IDS = 2000, 32, 4
#: Every setting; "auto" on a slow link so that it chooses to compress.
SETTINGS = ["none", "fp16", "bf16", "topk", "randomk", "sign", "qsgd", "powersgd", "auto"]


def aggregator(setting):
    if setting == "auto":
        agg = AutoCompression(link=LinkEstimate(bandwidth=1e6, latency=1e-4, num_replicas=2))
        agg.resolve(tfdist.strategy_from_config(cpu_replicas=2), _model().trainable_variables)
        assert agg.chosen is not None  # It compresses on 8 Mbit/s.
        return agg
    agg = make_aggregator(setting)
    return PowerSGD(agg.rank, warmup_steps=0) if isinstance(agg, PowerSGD) else agg


def _model(index_dtype="int64"):
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((IDS,), dtype=index_dtype),
            keras.layers.Embedding(VOCAB, DIM),
            keras.layers.Flatten(),
            keras.layers.Dense(64),
            keras.layers.Dense(3),
        ]
    )


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    # Duplicated ids on purpose: TensorFlow sends one slice per lookup.
    return rng.integers(0, 50, size=(n, IDS)).astype("int64"), rng.integers(0, 3, size=n)


def _gradients(tf, model, x, y, scale=1.0):
    import keras

    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = (
            tf.reduce_mean(
                keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            )
            * scale
        )
    return tape.gradient(loss, model.trainable_variables)


def test_an_embedding_table_is_counted_as_its_slices_not_as_a_matrix():
    model = _model()
    t = predict_traffic(model, "powersgd:4", num_replicas=2, batch_size=64)
    # 32 examples per replica x 4 ids = 128 slices of 32 float32 and their
    # int64 indices (17,408 B, as measured in DESIGN.md), plus the row count.
    slices = 4 + 128 * (DIM * 4 + 8)
    assert t.all_gather == t.dense_gather == slices == 17412
    dense_rest = (128 * 64 + 64 + 64 * 3 + 3) * 4
    assert t.dense == dense_rest  # The table is not in the all-reduce.
    # PowerSGD compresses the (64, 128) kernel to P and Q; among 2 replicas
    # an all-reduce of S bytes sends S and an all-gather S per replica.
    assert t.all_reduce == ((64 + 128) * 4 + 64 + 3 * 64 + 3) * 4
    assert t.sent == t.all_reduce + slices and t.dense_sent == dense_rest + slices
    assert t.ratio == pytest.approx(51216 / 21520)  # 2.38x (7.9x with the table as a matrix).
    # The cast sends the values in 16 bits; the indices stay int64.
    half = predict_traffic(model, "bf16", num_replicas=2, batch_size=64)
    assert half.all_gather == 4 + 128 * (DIM * 2 + 8)
    assert half.ratio == pytest.approx((dense_rest + slices) / (dense_rest / 2 + half.all_gather))
    # An int32 Input sends int32 indices; an odd batch pads to ceil(B / N).
    t32 = predict_traffic(_model("int32"), "none", num_replicas=2, batch_size=63)
    assert t32.all_gather == 4 + 32 * IDS * (DIM * 4 + 4)


def test_a_model_with_embeddings_needs_the_batch_size():
    from tfdist.compression.sparse import SparseGradient

    model = _model()
    with pytest.raises(tfdist.ConfigError) as info:
        predict_traffic(model, "powersgd:4", num_replicas=2)
    assert info.value.field == "batch_size" and "Embedding 'embedding" in str(info.value)
    with pytest.raises(tfdist.ConfigError) as info:
        predict_traffic(model, "none", num_replicas=2, batch_size=0)
    assert info.value.field == "batch_size"
    with pytest.raises(tfdist.ConfigError) as info:
        SparseGradient((VOCAB, DIM), "float32", rows=-1)
    assert info.value.field == "rows"
    with pytest.raises(tfdist.ConfigError) as info:
        SparseGradient((VOCAB, DIM), "float32", rows=8, index_dtype="float32")
    assert info.value.field == "index_dtype"


@pytest.mark.parametrize("setting", SETTINGS)
def test_predicted_equals_recorded_in_one_process(tf_cpus, setting):
    tf = tf_cpus
    model = _model()
    x, y = _data(24)
    grads = _gradients(tf, model, x, y)
    assert isinstance(grads[0], tf.IndexedSlices) and grads[0].values.shape[0] == 24 * IDS
    agg = aggregator(setting)
    items = []
    for key, (g, v) in enumerate(zip(grads, model.trainable_variables)):
        state = {}
        for spec in agg.state_specs(tuple(v.shape), "float32", key):
            init = (
                tf.zeros(spec.shape, spec.dtype)
                if spec.initializer == "zeros"
                else spec.initializer(spec.shape, spec.dtype)
            )
            state[spec.name] = tf.Variable(init)
        items.append(Item(g, key, state))
    comm = LocalComm()
    out = agg.aggregate(items, tf.constant(50, tf.int64), comm)
    predicted = predict_traffic(model, agg, num_replicas=1, batch_size=24)
    recorded = comm.traffic(predicted.dense, predicted.dense_gather)
    assert (predicted.all_reduce, predicted.all_gather) == (
        recorded.all_reduce,
        recorded.all_gather,
    )
    # The slices pass every compressor; a cast sends their values in 16 bits.
    [(row, values, indices, _)] = comm.sliced
    cast = {"fp16": "float16", "bf16": "bfloat16"}.get(setting, "float32")
    assert (row, values, indices) == ((DIM,), cast, "int64")
    assert isinstance(out[0], tf.IndexedSlices) and out[0].values.dtype == tf.float32
    tol = {"float32": 0, "float16": 1e-3, "bfloat16": 1e-2}[cast]
    np.testing.assert_allclose(out[0].values, grads[0].values, rtol=tol, atol=tol * 1e-2)


def _replica_state(tf, strategy, agg, variables):
    state = {}
    with strategy.scope():
        for key, v in enumerate(variables):
            for spec in agg.state_specs(tuple(v.shape), "float32", key):
                init = (
                    tf.zeros(spec.shape, spec.dtype)
                    if spec.initializer == "zeros"
                    else spec.initializer(spec.shape, spec.dtype)
                )
                state.setdefault(key, {})[spec.name] = tf.Variable(
                    init,
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                )
    return state


@pytest.mark.parametrize("setting", ["none", "bf16", "topk", "powersgd"])
def test_predicted_equals_recorded_on_two_replicas(tf_cpus, setting):
    tf = tf_cpus
    strategy = tfdist.strategy_from_config(cpu_replicas=2)
    with strategy.scope():
        model = _model()
    x, y = _data(5, seed=1)
    split = [(x[:3], y[:3]), (x[3:], y[3:])]  # 3 and 2 examples: TF pads to 3.
    agg = aggregator(setting)
    state = _replica_state(tf, strategy, agg, model.trainable_variables)
    inputs = strategy.experimental_distribute_values_from_function(
        lambda ctx: split[ctx.replica_id_in_sync_group]
    )

    @tf.function
    def step(batch):
        def replica_fn(batch):
            grads = _gradients(tf, model, batch[0], batch[1])
            comm = ReplicaComm()
            items = [Item(g, k, state.get(k, {})) for k, g in enumerate(grads)]
            out = agg.aggregate(items, tf.constant(50, tf.int64), comm)
            return tf.convert_to_tensor(out[0]), [r for *_, r in comm.sliced]

        return strategy.run(replica_fn, args=(batch,))

    table, rows = step(inputs)
    per_replica_rows = [
        [int(r) for r in strategy.experimental_local_results(count)] for count in rows
    ]
    assert per_replica_rows == [[3 * IDS, 2 * IDS]]

    # Recorded (the real collectives' tensors, at the largest replica's rows)
    # equals predicted from the global batch of 5.
    predicted = predict_traffic(model, agg, num_replicas=2, batch_size=5)
    comm = _trace_comm(tf, strategy, model, agg, state, inputs)
    recorded = comm.traffic(
        predicted.dense, predicted.dense_gather, rows=[max(r) for r in per_replica_rows]
    )
    assert (recorded.all_reduce, recorded.all_gather, recorded.sent, recorded.dense_sent) == (
        predicted.all_reduce,
        predicted.all_gather,
        predicted.sent,
        predicted.dense_sent,
    )
    # 3 examples x 4 ids on the fuller replica, int64 indices.
    assert predicted.dense_gather == 4 + 3 * IDS * (DIM * 4 + 8)
    if setting in ("none", "bf16", "powersgd"):  # Nothing else is gathered.
        assert predicted.all_gather == 4 + 3 * IDS * (DIM * (2 if setting == "bf16" else 4) + 8)

    # Every replica holds the sum of both replicas' table gradients
    # (duplicates summed when densified); bf16 within its precision.
    expected = sum(
        tf.convert_to_tensor(_gradients(tf, model, bx, by)[0]).numpy() for bx, by in split
    )
    tol = 1e-2 if setting == "bf16" else 1e-6
    for copy in strategy.experimental_local_results(table):
        np.testing.assert_allclose(copy, expected, rtol=tol, atol=tol * np.abs(expected).max())


def _trace_comm(tf, strategy, model, agg, state, inputs):
    """The ReplicaComm of replica 0 in a traced step (its records are static)."""
    comms = []

    @tf.function
    def step(batch):
        def replica_fn(batch):
            comm = ReplicaComm()
            comms.append(comm)
            grads = _gradients(tf, model, batch[0], batch[1])
            items = [Item(g, k, state.get(k, {})) for k, g in enumerate(grads)]
            return tf.convert_to_tensor(agg.aggregate(items, tf.constant(50, tf.int64), comm)[0])

        return strategy.run(replica_fn, args=(batch,))

    step(inputs)
    return comms[0]


@pytest.mark.parametrize("setting", SETTINGS)
def test_fit_reports_the_bytes_predicted_for_each_batch(tf_cpus, setting):
    import keras

    from tfdist.compression import CommunicationStats

    compression = aggregator(setting) if setting in ("auto", "powersgd") else setting
    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=compression)
    with strategy.scope():
        model = _model()
        model.compile(
            optimizer=keras.optimizers.SGD(0.05),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    x, y = _data(160, seed=2)
    stats = CommunicationStats(every_batch=True)
    per_batch = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            per_batch.append(logs["comm_bytes"])

    history = model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[stats, Record()])
    assert np.isfinite(history.history["loss"]).all()
    agg = record_of(strategy).aggregator or "none"
    # 64, 64, then the last 32 examples: 16 per replica ("auto" chose a
    # PowerSGD whose warm-up steps are dense).
    expected = [
        predict_traffic(model, agg, num_replicas=2, batch_size=b, step=i).sent
        for i, b in enumerate((64, 64, 32))
    ]
    assert per_batch == expected
    full = predict_traffic(model, agg, num_replicas=2, batch_size=64)
    assert full.dense_gather == 4 + 32 * IDS * (DIM * 4 + 8)
    if setting in ("fp16", "bf16"):
        assert full.all_gather == 4 + 32 * IDS * (DIM * 2 + 8)
    elif setting in ("none", "randomk", "powersgd"):  # All-reduce only, besides the slices.
        assert full.all_gather == full.dense_gather


@pytest.mark.parametrize("setting", ["none", "bf16", "powersgd"])
def test_communication_stats_counts_the_slices_not_the_table(tf_cpus, setting):
    # Figures by hand from TensorFlow's protocol (no tfdist formula): a batch
    # of 64 on 2 replicas, 32 x 4 = 128 slices per replica.
    import keras

    from tfdist.compression import CommunicationStats

    compression = PowerSGD(4, warmup_steps=0) if setting == "powersgd" else setting
    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=compression)
    with strategy.scope():
        model = _model()
        model.compile(
            optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    x, y = _data(128, seed=3)
    stats = CommunicationStats(every_batch=True)
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[stats])
    kernel, biases = 128 * 64 + 64 * 3, 64 + 3
    value = 2 if setting == "bf16" else 4
    slices = 4 + 128 * (DIM * value + 8)  # Row count, values, int64 indices.
    reduced = {
        "none": (kernel + biases) * 4,
        "bf16": (kernel + biases) * 2,
        "powersgd": ((64 + 128) * 4 + 3 * 64 + biases) * 4,
    }[setting]
    # Among 2 replicas each sends S of an all-reduce of S and S of a gather.
    assert stats.last.sent == reduced + slices
    assert stats.last.dense_sent == (kernel + biases) * 4 + 4 + 128 * (DIM * 4 + 8)


def _collective_dtypes(concrete):
    """dtype names of every CollectiveGatherV2 in a traced function, branches included."""
    import tensorflow as tf

    graph = concrete.graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return sorted(
        {tf.dtypes.as_dtype(n.attr["T"].type).name for n in nodes if n.op == "CollectiveGatherV2"}
    )


@pytest.mark.parametrize(
    "setting, wire",
    [("none", "float32"), ("bf16", "float16"), ("fp16", "float16"), ("powersgd", "float32")],
)
def test_the_wire_dtype_of_the_slices_in_the_traced_collectives(tf_cpus, setting, wire):
    # bf16 values travel bit for bit as float16 (the collectives gather no
    # bfloat16); the row count is int32 and the indices int64.
    tf = tf_cpus
    strategy = tfdist.strategy_from_config(cpu_replicas=2)
    with strategy.scope():
        model = _model()
    agg = make_aggregator(setting)
    state = _replica_state(tf, strategy, agg, model.trainable_variables)
    x, y = _data(8)

    @tf.function
    def step(x, y):
        def replica_fn():
            grads = _gradients(tf, model, x, y)
            items = [Item(g, k, state.get(k, {})) for k, g in enumerate(grads)]
            return tf.convert_to_tensor(
                agg.aggregate(items, tf.constant(50, tf.int64), ReplicaComm())[0]
            )

        return strategy.run(replica_fn)

    assert _collective_dtypes(step.get_concrete_function(x, y)) == sorted({"int32", "int64", wire})


@pytest.mark.slow
def test_two_workers_gather_slices_in_bf16_and_count_them():
    from conftest import finish, result_line, start
    from tfdist import spec as spec_lib
    from tfdist.engines.net import local_spec

    procs = [
        start(["tests/workers/sparse_fit.py"], tf_config=config)
        for _, _, config in spec_lib.all_task_configs(local_spec(2))
    ]
    results = finish(procs, timeout=300)
    for code, _out, err in results:
        assert code == 0, f"worker failed ({code}):\n{err[-4000:]}"
    chief, other = (result_line(out) for _, out, _ in results)
    assert chief["replicas"] == other["replicas"] == 2

    # Both workers hold the sum of both workers' slices (3 and 5 rows; the
    # 3 are padded to 5), densified: exact uncompressed, bf16 within 1e-2.
    expected = np.zeros((20, 8), "float32")
    for index in (0, 1):
        rows = 3 + 2 * index
        values = np.arange(rows * 8, dtype="float32").reshape(rows, 8) / 7.0 + index + 0.1
        np.add.at(expected, (np.arange(rows) * 3 + index) % 7, values)
    for worker in (chief, other):
        np.testing.assert_allclose(worker["none"], expected, rtol=1e-6)
        np.testing.assert_allclose(worker["bf16"], expected, rtol=1e-2)
        assert not np.array_equal(worker["bf16"], worker["none"])  # Really 16 bits.
        assert (worker["none_wire"], worker["bf16_wire"]) == ("float32", "bfloat16")
    assert (chief["none_rows"], other["none_rows"]) == (3, 5)

    # fit under bf16: what each worker's callback counted per batch is what
    # predict_traffic gives for batches of 64, 64 and 32, the weights agree.
    for worker in (chief, other):
        assert worker["counted"] == worker["predicted"]
    kernel = (128 * 3 + 3) * 2  # The Dense layer, in bf16.
    slices = 4 + 32 * 4 * (32 * 2 + 8)  # 32 examples x 4 ids, bf16 values, int64 ids.
    assert chief["counted"][0] == kernel + slices
    assert chief["weights"] == other["weights"] and chief["loss"] == other["loss"]


def test_sparse_gradients_the_model_does_not_predict_raise_instead_of_misreporting(tf_cpus):
    # A layer of the user's own that gathers rows from a weight sends
    # IndexedSlices that no Embedding layer predicts: CommunicationStats
    # says so rather than count the weight as an all-reduced matrix.
    import keras

    from tfdist.compression import CommunicationStats

    tf = tf_cpus

    class Lookup(keras.layers.Layer):
        def build(self, input_shape):
            self.table = self.add_weight(shape=(50, 8), name="table")

        def call(self, ids):
            return tf.gather(self.table, tf.cast(ids, "int32"))

    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression="bf16")
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((IDS,), dtype="int64"),
                Lookup(),
                keras.layers.Flatten(),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    x, y = _data(64)
    with pytest.raises(tfdist.ConfigError, match=r"IndexedSlices sent .*\(8,\), 'int32'"):
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[CommunicationStats()])


def test_an_embedding_of_unknown_input_length_needs_explicit_specs():
    import keras

    from tfdist.compression.sparse import SparseGradient

    model = keras.Sequential(
        [
            keras.Input((None,), dtype="int64"),
            keras.layers.Embedding(VOCAB, DIM),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )
    with pytest.raises(tfdist.ConfigError, match="SparseGradient") as info:
        predict_traffic(model, "bf16", num_replicas=2, batch_size=64)
    assert info.value.field == "model"
    # Said explicitly: 32 examples of 10 ids on the fuller replica.
    specs = [
        SparseGradient((VOCAB, DIM), "float32", rows=320, index_dtype="int64"),
        ((DIM, 3), "float32"),
        ((3,), "float32"),
    ]
    t = predict_traffic(specs, "bf16", num_replicas=2)
    assert t.all_gather == 4 + 320 * (DIM * 2 + 8) and t.all_reduce == (DIM * 3 + 3) * 2


def test_a_shared_table_sends_the_slices_of_every_call(tf_cpus):
    # One Embedding called on a 4-id and a 6-id input: its gradient is one
    # IndexedSlices of 10 slices per example.
    import keras

    tf = tf_cpus
    a, b = keras.Input((4,), dtype="int32"), keras.Input((6,), dtype="int32")
    table = keras.layers.Embedding(VOCAB, DIM)
    joined = keras.layers.Concatenate()(
        [keras.layers.Flatten()(table(a)), keras.layers.Flatten()(table(b))]
    )
    model = keras.Model([a, b], keras.layers.Dense(3)(joined))
    rng = np.random.default_rng(4)
    xa, xb = rng.integers(0, 50, (12, 4)), rng.integers(0, 50, (12, 6))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model([xa, xb]))
    grad = tape.gradient(loss, model.trainable_variables)[0]
    assert isinstance(grad, tf.IndexedSlices) and grad.values.shape[0] == 12 * 10
    t = predict_traffic(model, "none", num_replicas=1, batch_size=12)
    assert t.all_gather == 4 + 12 * 10 * (DIM * 4 + grad.indices.dtype.size)


def test_communication_stats_counts_one_step_with_steps_per_execution(tf_cpus):
    import keras

    from tfdist.compression import CommunicationStats

    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression="bf16")
    with strategy.scope():
        model = _model()
        model.compile(
            optimizer="sgd",
            steps_per_execution=2,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    x, y = _data(256, seed=5)
    stats = CommunicationStats()
    model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[stats])
    assert stats.last.sent == predict_traffic(model, "bf16", num_replicas=2, batch_size=64).sent


def test_fit_with_16_bit_slices_trains_as_uncompressed(tf_cpus):
    # End to end through the Keras hook: the Embedding table trained with
    # its slices sent in bf16 (and fp16) stays within 16-bit precision of
    # the uncompressed run.
    import keras

    x, y = _data(256, seed=6)
    runs = {}
    for setting in ("none", "bf16", "fp16"):
        strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=setting)
        with strategy.scope():
            model = _model()
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        before = model.get_weights()[0].copy()
        losses = model.fit(x, y, batch_size=64, epochs=3, verbose=0).history["loss"]
        runs[setting] = losses, model.get_weights()[0] - before
    losses, moved = runs["none"]
    assert losses[-1] < losses[0] and np.abs(moved).max() > 1e-3
    for setting in ("bf16", "fp16"):
        np.testing.assert_allclose(runs[setting][0], losses, rtol=1e-2)
        np.testing.assert_allclose(
            runs[setting][1], moved, rtol=0.05, atol=0.02 * np.abs(moved).max()
        )
        assert not np.array_equal(runs[setting][1], moved)  # Really sent in 16 bits.


@pytest.mark.parametrize("setting", [None, "bf16"])
def test_a_custom_loop_reads_the_bytes_of_its_embedding_slices(tf_cpus, setting):
    import keras

    from tfdist.compression import step_traffic
    from tfdist.errors import ConfigError

    tf, batch = tf_cpus, 64
    strategy = tfdist.strategy_from_config(cpu_replicas=2, compression=setting)
    with strategy.scope():
        model = _model()
        optimizer = keras.optimizers.SGD(0.1)
    x, y = _data(batch)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    )

    @tf.function
    def step(inputs):
        def replica_step(features, labels):
            with tf.GradientTape() as tape:
                logits = model(features, training=True)
                loss = tf.nn.compute_average_loss(
                    keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True),
                    global_batch_size=batch,
                )
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))

        strategy.run(replica_step, args=inputs)

    for inputs in dataset:
        step(inputs)
    # The table's gradient was IndexedSlices: without the model and the
    # batch, counting it as a matrix would be wrong, so it is refused.
    with pytest.raises(ConfigError, match="'model'.*IndexedSlices"):
        step_traffic(optimizer)
    sent = step_traffic(optimizer, model=model, batch_size=batch)
    predicted = predict_traffic(model, setting or "none", num_replicas=2, batch_size=batch)
    assert sent == predicted
    assert sent.all_gather == 4 + 32 * IDS * (DIM * (2 if setting else 4) + 8)
