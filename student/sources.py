"""The two sample sources a student trains from: a live teacher (`StreamSource`) and a spool folder
(`SpoolSource`), behind the same small interface (below). `student.data` re-exports them."""

from __future__ import annotations

import time
from collections.abc import Iterator

from distill.errors import ProtocolError, SpoolChecksumError, TeacherGone
from distill.protocol import Sample
from student.errors import StudentError

# ---------------------------------------------------------------------------------------------
# Sample sources: the same small interface over a live teacher and a spool folder.
#   get(timeout) -> Sample | None     None on timeout, or when `exhausted`
#   exhausted                          no sample will ever come again
#   run_ended                          the teacher said every key is committed: every rank may stop
#   draining                           the teacher has nothing waiting: flush partial batches now
#   ack(samples)                       after the optimizer step that used them
#   valid(sample) -> bool              after collate copied it: False = its memory was reused (stale)
#   discard(samples)                   forget stale samples without acking (the teacher redelivers)
#   commit()                           a checkpoint covers everything acked so far
#   uncommitted                        acked, not yet committed
# ---------------------------------------------------------------------------------------------


class SpoolSource:
    """This rank's share of a spool folder (files rank, rank + W, ...), minus already-trained keys."""

    def __init__(
        self, directory: str, rank: int, world_size: int, skip_keys: set[str], layers: list[int] | None = None
    ):
        self.directory = directory
        self.layers = layers  # for files without layer ids (vLLM's connector writes none)
        try:
            self._it: Iterator[Sample] | None = iter_spool_checked(directory, rank, world_size, skip_keys)
        except FileNotFoundError as e:
            raise StudentError(str(e)) from None
        self.exhausted = False
        self.draining = True  # nothing will arrive later: never wait for more
        self.wait_s = 0.0  # time spent reading files
        self.credit_window: int | None = None  # no teacher limits what this rank holds

    def get(self, timeout: float = 0.0) -> Sample | None:
        if self._it is None:
            return None
        t0 = time.perf_counter()
        try:
            s = next(self._it)
            if not s.layers:
                if self.layers is None:
                    raise StudentError(
                        f"spool file for {s.key!r} in {self.directory!r} does not record its layer ids "
                        "(vLLM's ExampleHiddenStatesConnector writes none): set student.spool_layers "
                        "to the extracted layer ids, in order"
                    )
                s.layers = list(self.layers)
            return s
        except StopIteration:
            self._it = None
            self.exhausted = True
            return None
        except SpoolChecksumError as e:
            raise StudentError(
                f"damaged spool file: {e}; delete it and run distill-teacher with the same run file "
                "to generate that sample again"
            ) from None
        finally:
            self.wait_s += time.perf_counter() - t0

    def ack(self, samples: list[Sample]) -> None:
        pass  # spool files are kept: the folder is the data set

    def valid(self, sample: Sample) -> bool:
        return True  # files are read into memory of our own

    def discard(self, samples: list[Sample]) -> None:
        pass

    def commit(self) -> None:
        pass

    uncommitted = 0
    run_ended = False  # this rank's share is read; the other ranks' shares may not be

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        self._it = None


def iter_spool_checked(directory: str, rank: int, world_size: int, skip_keys: set[str]) -> Iterator[Sample]:
    """iter_spool, with the empty-folder check done now rather than at the first `next`."""
    from distill.spool import iter_spool, list_spool

    if not list_spool(directory):
        raise FileNotFoundError(
            f"spool folder {directory!r} has no *.safetensors files: run the teacher with a spool first, "
            "or point student.spool_dir (or spool.dir) at the folder it wrote"
        )
    return iter_spool(directory, rank=rank, world_size=world_size, skip_keys=skip_keys)


class StreamSource:
    """A live teacher (or several) through distill.transport.Subscriber."""

    def __init__(self, transport_cfg, skip_keys: set[str], commit_on_ack: bool = True):
        from distill import transport

        self._errors = (ProtocolError, transport.TransportError)  # both end the run with a clear message
        try:
            # fp8 samples stay fp8 until Batch.to dequantizes them on the device (half the host traffic)
            self.sub = transport.Subscriber(
                transport_cfg, skip_keys=skip_keys, commit_on_ack=commit_on_ack, dequantize=False
            )
            self.sub.start()
        except self._errors as e:
            raise StudentError(transport_message(e)) from None
        self.wait_s = 0.0  # time blocked waiting for the teacher

    @property
    def credit_window(self) -> int:
        """The most unacked samples the teachers let this rank hold."""
        return self.sub.credit_window

    @property
    def exhausted(self) -> bool:
        return bool(self.sub.finished)

    @property
    def run_ended(self) -> bool:
        return bool(self.sub.finished)  # END comes only once every key of the run is committed

    @property
    def draining(self) -> bool:
        return bool(self.sub.draining)

    def get(self, timeout: float = 0.0) -> Sample | None:
        t0 = time.perf_counter()
        try:
            return self.sub.get(timeout=timeout)
        except TeacherGone:  # a TransportError: caught first, raised as it is (exit 3)
            raise
        except self._errors as e:
            raise StudentError(transport_message(e)) from None
        finally:
            self.wait_s += time.perf_counter() - t0

    def ack(self, samples: list[Sample]) -> None:
        if samples:
            self.sub.ack(samples)

    def valid(self, sample: Sample) -> bool:
        return bool(self.sub.valid(sample))

    def discard(self, samples: list[Sample]) -> None:
        if samples:
            self.sub.discard(samples)

    def commit(self) -> None:
        self.sub.commit()

    @property
    def uncommitted(self) -> int:
        return int(self.sub.uncommitted)

    def stats(self) -> dict:
        return dict(self.sub.stats())

    def close(self) -> None:
        self.sub.close()


def transport_message(e: Exception) -> str:
    """The user-facing text for a transport failure (the Subscriber's own text names the cause)."""
    if getattr(e, "reason", None) == "version":
        return f"the teacher speaks another protocol version ({e}): run teacher and students from the same release"
    return f"transport: {e}"
