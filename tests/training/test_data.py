"""Global batch size and the auto-shard policy choice (tfdist.training.data).

The policies are checked against TensorFlow's own auto-shard rewrite
(``_AutoShardDataset``, what ``experimental_distribute_dataset`` applies on
each worker): what each worker would read is compared with what it should
read, worked out from the files here.
"""

from __future__ import annotations

import warnings

import pytest

import tfdist
from tfdist.errors import ConfigError

FILES = 3
RECORDS = 4  # per file


@pytest.fixture(scope="module")
def data_mod(tf_cpus):
    from tfdist.training import data

    return data


@pytest.fixture(scope="module")
def strategy2(tf_cpus):
    return tfdist.strategy_from_config(cpu_replicas=2)


@pytest.fixture()
def record_files(tf_cpus, tmp_path):
    """FILES TFRecord files; record j of file i is b'f{i}-r{j}'."""
    tf = tf_cpus
    paths = []
    for i in range(FILES):
        path = str(tmp_path / f"part-{i}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for j in range(RECORDS):
                writer.write(f"f{i}-r{j}".encode())
        paths.append(path)
    return paths


def worker_view(tf, dataset, workers, index):
    """What worker ``index`` reads after TensorFlow's auto-shard rewrite."""
    from tensorflow.python.data.experimental.ops.distribute import _AutoShardDataset

    shard = _AutoShardDataset(dataset, num_workers=workers, index=index)
    return [v.numpy() for v in shard]


def choose_quietly(data_mod, dataset, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decision = data_mod.choose_shard_policy(dataset, **kwargs)
    return decision, [w for w in caught if issubclass(w.category, data_mod.ShardingWarning)]


def test_global_batch_size(strategy2, data_mod):
    assert data_mod.global_batch_size(32, strategy2) == 64
    assert data_mod.global_batch_size(1, strategy2) == 2
    for bad in (0, -4, 2.5, True, "32", None):
        with pytest.raises(ConfigError) as error:
            data_mod.global_batch_size(bad, strategy2)
        assert "field 'per_replica_batch'" in str(error.value)
        assert f"Received: {bad!r}" in str(error.value)
    with pytest.raises(ConfigError, match="field 'strategy'"):
        data_mod.global_batch_size(32, None)


def test_in_memory_sources_are_sharded_by_data(tf_cpus, data_mod):
    tf = tf_cpus
    sources = {
        "from_tensor_slices": tf.data.Dataset.from_tensor_slices(tf.range(8)),
        "range": tf.data.Dataset.range(8).map(lambda v: v * 2).batch(2),
        "from_generator": tf.data.Dataset.from_generator(
            lambda: iter(range(8)), output_signature=tf.TensorSpec([], tf.int64)
        ),
    }
    for name, dataset in sources.items():
        decision, caught = choose_quietly(data_mod, dataset, workers=2)
        assert decision.policy == tf.data.experimental.AutoShardPolicy.DATA, name
        assert not decision.reads_files, name
        assert decision.reason.startswith("DATA: the dataset reads no files"), name
        assert caught == [], name  # The expected case: no warning.


def test_file_sharding_on_from_tensor_slices_fails_only_at_first_read(tf_cpus, data_mod):
    # Why tfdist decides up front: TensorFlow accepts FILE here, and fails
    # only when the data is read.
    tf = tf_cpus
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.FILE
    dataset = tf.data.Dataset.from_tensor_slices(tf.range(8)).with_options(options)
    with pytest.raises(tf.errors.NotFoundError):
        worker_view(tf, dataset, 2, 0)
    with pytest.raises(ConfigError) as error:
        data_mod.distribute_dataset(
            tf.data.Dataset.from_tensor_slices(tf.range(8)), None, policy="file", distribute=False
        )
    assert "field 'policy'" in str(error.value) and "reads no files" in str(error.value)


def test_enough_files_are_sharded_by_file(tf_cpus, data_mod, record_files):
    tf = tf_cpus
    readers = {
        "TFRecordDataset(list)": tf.data.TFRecordDataset(record_files),
        "TFRecordDataset(list).map.batch": tf.data.TFRecordDataset(record_files)
        .map(tf.strings.upper)
        .batch(2),
        "list_files.interleave": tf.data.Dataset.list_files(
            str(record_files[0]).replace("part-0", "part-*"), shuffle=False
        ).interleave(tf.data.TFRecordDataset, cycle_length=2),
        "parallel reads": tf.data.TFRecordDataset(record_files, num_parallel_reads=2),
    }
    for name, dataset in readers.items():
        decision, caught = choose_quietly(data_mod, dataset, workers=2)
        assert decision.policy == tf.data.experimental.AutoShardPolicy.FILE, name
        assert decision.num_files == FILES, name
        assert caught == [], name
    decision, _ = choose_quietly(data_mod, readers["TFRecordDataset(list)"], workers=3)
    assert decision.policy == tf.data.experimental.AutoShardPolicy.FILE

    # And FILE does what it should: worker w reads exactly the files i with
    # i % 2 == w, every record of them, in file order.
    dataset = data_mod.distribute_dataset(
        tf.data.TFRecordDataset(record_files), None, distribute=False
    )
    assert (
        dataset.options().experimental_distribute.auto_shard_policy
        == tf.data.experimental.AutoShardPolicy.FILE
    )
    for worker in range(2):
        expected = [
            f"f{i}-r{j}".encode() for i in range(FILES) if i % 2 == worker for j in range(RECORDS)
        ]
        assert worker_view(tf, dataset, 2, worker) == expected


def test_fewer_files_than_workers_warn_and_shard_by_data(tf_cpus, data_mod, record_files):
    tf = tf_cpus
    one_file = tf.data.TFRecordDataset(record_files[:1])
    decision, caught = choose_quietly(data_mod, one_file, workers=2)
    assert decision.policy == tf.data.experimental.AutoShardPolicy.DATA
    assert decision.reads_files and decision.num_files == 1
    assert len(caught) == 1
    assert "only 1 file(s) for 2 workers" in str(caught[0].message)
    assert "fails at its first read" in str(caught[0].message)

    decision, caught = choose_quietly(data_mod, tf.data.TFRecordDataset(record_files), workers=4)
    assert decision.policy == tf.data.experimental.AutoShardPolicy.DATA
    assert "only 3 file(s) for 4 workers" in str(caught[0].message)

    # TensorFlow's AUTO picks FILE here: worker 0 fails when it first reads,
    # and worker 1 silently reads nothing...
    with pytest.raises(tf.errors.InvalidArgumentError, match="Could not apply FILE based sharding"):
        worker_view(tf, tf.data.TFRecordDataset(record_files[:1]), 2, 0)
    assert worker_view(tf, tf.data.TFRecordDataset(record_files[:1]), 2, 1) == []
    # ...while tfdist's DATA gives the two workers disjoint halves of it.
    dataset = tf.data.TFRecordDataset(record_files[:1])
    with pytest.warns(data_mod.ShardingWarning):
        decision = data_mod.choose_shard_policy(dataset, workers=2)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = decision.policy
    dataset = dataset.with_options(options)
    views = [worker_view(tf, dataset, 2, w) for w in range(2)]
    everything = [f"f0-r{j}".encode() for j in range(RECORDS)]
    assert views == [everything[0::2], everything[1::2]]


def test_explicit_file_policy_checks_the_file_count(tf_cpus, data_mod, record_files):
    tf = tf_cpus
    decision, _ = choose_quietly(data_mod, tf.data.TFRecordDataset(record_files[:1]), workers=1)
    assert decision.policy == tf.data.experimental.AutoShardPolicy.FILE
    with pytest.raises(ConfigError, match="field 'policy'"):
        data_mod.distribute_dataset(tf.data.Dataset.range(4), None, policy="file", distribute=False)
    for bad in ("files", 3, None):
        with pytest.raises(ConfigError, match="field 'policy'"):
            data_mod.distribute_dataset(
                tf.data.Dataset.range(4), None, policy=bad, distribute=False
            )


def test_uncounted_files_warn_unless_given(tf_cpus, data_mod, record_files):
    tf = tf_cpus
    # The file names go through a map: their number is only known at run time.
    dataset = (
        tf.data.Dataset.from_tensor_slices(record_files)
        .map(tf.strings.strip)
        .flat_map(tf.data.TFRecordDataset)
    )
    decision, caught = choose_quietly(data_mod, dataset, workers=2)
    assert decision.policy == tf.data.experimental.AutoShardPolicy.DATA
    assert decision.reads_files and decision.num_files is None
    assert "could not be counted" in str(caught[0].message)
    decision, caught = choose_quietly(data_mod, dataset, workers=2, files=record_files)
    assert decision.policy == tf.data.experimental.AutoShardPolicy.FILE
    assert decision.num_files == FILES and caught == []


def test_distribute_dataset_batches_by_the_global_batch(tf_cpus, data_mod, strategy2):
    tf = tf_cpus
    dataset = data_mod.distribute_dataset(
        tf.data.Dataset.range(10), strategy2, per_replica_batch=2, distribute=False
    )
    assert [b.numpy().tolist() for b in dataset] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert (
        dataset.options().experimental_distribute.auto_shard_policy
        == tf.data.experimental.AutoShardPolicy.DATA
    )
    distributed = data_mod.distribute_dataset(
        tf.data.Dataset.range(8), strategy2, per_replica_batch=2
    )
    first = next(iter(distributed))
    parts = [t.numpy().tolist() for t in strategy2.experimental_local_results(first)]
    assert parts == [[0, 1], [2, 3]]
