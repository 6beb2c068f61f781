"""Answers through Ray: an object reference waited for, and Ray's errors turned into
shardflow's, here and nowhere else, so that nothing above ``runtime/ray/`` knows Ray's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

import ray
from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

from shardflow.errors import ClusterError, Error, ResultLost, WorkerGone, WorkerTimeout

if TYPE_CHECKING:
    from ray import ObjectRef

T = TypeVar("T")


def translate(error: Exception, who: str) -> Error:
    """Ray's error as shardflow's: the callee's own error as itself, a dead actor as
    ``WorkerGone``, no answer in time as ``WorkerTimeout``, a lost object as
    :class:`ResultLost`, anything else as ``ClusterError``."""
    if isinstance(error, RayTaskError):  # raised by the callee (checked first: Ray makes
        cause = error.cause  # it an instance of the cause's class too)
        if isinstance(cause, ObjectLostError):
            return ResultLost(f"{who}: an input was lost: {cause}")
        if isinstance(cause, Error):
            return cause
        if isinstance(cause, RayActorError):
            return WorkerGone(f"{who}: a worker it called is gone: {cause}")
        return ClusterError(f"{who} failed: {cause!r}")
    if isinstance(error, ObjectLostError):
        return ResultLost(f"{who}: a result was lost: {error}")
    if isinstance(error, GetTimeoutError):
        return WorkerTimeout(f"{who} did not answer in time")
    if isinstance(error, RayActorError):
        return WorkerGone(f"{who} is gone: {error}")
    if isinstance(error, Error):
        return error
    return ClusterError(f"{who} failed: {error!r}")


class RayReply(Generic[T]):
    """An answer on its way through Ray's object store."""

    def __init__(self, ref: ObjectRef[T], who: str) -> None:
        self.ref = ref
        self.who = who

    def get(self, timeout: float | None = None) -> T:
        try:
            return ray.get(self.ref, timeout=timeout)
        except Exception as error:
            raise translate(error, self.who) from None
