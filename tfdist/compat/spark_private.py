"""PySpark's private attributes that tfdist reads, by name.

PySpark 4 keeps these only under a private name: its JVM gateway before any
context, the running SparkContext, and the JVM side of a context. The
``pyspark`` module and its objects are taken as arguments: importing this
module imports no PySpark (the launcher side imports it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["active_spark_context", "jvm_spark_context", "launch_conf"]


def launch_conf(pyspark: Any) -> Any:
    """A ``SparkConf`` read from Spark's JVM, started (or joined) with no
    SparkContext: spark-submit's settings and ``spark-defaults.conf``."""
    # Starts PySpark's JVM gateway to read spark.master before any session;
    # SparkConf takes the gateway only through its private _jvm argument.
    pyspark.SparkContext._ensure_initialized()
    return pyspark.SparkConf(_jvm=pyspark.SparkContext._jvm)


def active_spark_context(pyspark: Any) -> Any:
    """The SparkContext running in this process, or None."""
    # PySpark's only handle on a running SparkContext.
    return pyspark.SparkContext._active_spark_context


def jvm_spark_context(sc: Any) -> Any:
    """The JVM SparkContext behind a Python one."""
    # Free task slots have no Python API: the JVM SparkContext has them.
    return sc._jsc.sc()
