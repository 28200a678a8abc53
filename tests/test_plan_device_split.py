"""trident_dev/plan/device_split.py: a profiled GPU step split by the device's timeline, each kernel to the op it was
launched for (from hand-built profiler events: CI has no GPU; the H200 run is in docs/planning.md), and
trident/step_profile.py's profile_events reading a GPU profile: the links torch's events lack before 2.12, the
device's copies of record_function spans left out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trident.step_profile import profile_events
from trident_dev.plan.breakdown import CP_MARK, PASSES_MARK, STEP_MARK, Event
from trident_dev.plan.device_split import split_device_step

MAIN, AUTOGRAD, DEVICE = 1, 2, 99


def op(name: str, start: float, end: float, corr: int, thread: int = MAIN) -> Event:
    return Event(name, thread, start, end, "cpu", corr)


def launch(start: float, corr: int, link: int, thread: int = MAIN) -> Event:
    """The CUDA runtime call that launched kernel ``corr`` for op ``link``."""
    return Event("cudaLaunchKernel", thread, start, start + 0.01, "cpu", corr, link)


def kernel(name: str, start: float, end: float, corr: int, link: int) -> Event:
    return Event(name, DEVICE, start, end, "cuda", corr, link)


def test_a_gpu_step_splits_by_the_devices_timeline_each_kernel_to_the_op_it_was_launched_for() -> None:
    events = [
        Event(STEP_MARK, MAIN, 0.0, 10.0),
        Event(PASSES_MARK, MAIN, 0.0, 8.0),
        # The host launches ahead; the device runs each kernel later, for as long as it takes. Op ids and the
        # launches' CUDA ids are separate spaces: they overlap here on purpose.
        op("aten::addmm", 0.1, 0.2, 1),
        launch(0.15, 1, 1),
        op("aten::gelu", 0.2, 0.3, 2),
        launch(0.25, 2, 2),
        op("aten::_scaled_dot_product_flash_attention", 0.3, 0.4, 3),
        launch(0.35, 3, 3),
        op("c10d::allreduce_", 0.5, 0.6, 4),  # a tp all-reduce on NCCL's stream
        launch(0.55, 4, 4),
        op("aten::_fused_adamw_", 8.5, 8.6, 5),  # the device half of the optimizer
        launch(8.55, 5, 5),
        op("c10d::allreduce_", 8.2, 8.3, 6),  # the dp reduction after the passes
        launch(8.25, 6, 6),
        op("aten::_fused_adamw_", 9.0, 9.5, 0),  # an offloaded half on the host, the device idle meanwhile
        Event("cudaDeviceSynchronize", MAIN, 9.9, 10.0, "cpu", 7),  # a runtime call outside any op: CUDA's own id
        kernel("kernel_a", 1.0, 3.0, 1, 1),  # a name that says nothing: the addmm's matmul
        kernel("kernel_b", 3.0, 3.5, 2, 2),
        kernel("flash_fwd_kernel", 3.5, 4.5, 3, 3),
        kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 4.0, 5.0, 4, 4),  # half of it behind the attention
        kernel("Memcpy HtoD (Pinned -> Device)", 5.0, 5.2, 8, 0),  # linked to nothing
        kernel("kernel_c", 8.1, 8.2, 9, 2),  # launched in the passes (by the gelu's launch 9), run after them
        launch(0.28, 9, 2),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 8.6, 8.8, 6, 6),
        kernel("multi_tensor_apply_kernel", 8.8, 9.0, 5, 5),
    ]
    split = split_device_step(events, data_s=0.3)
    assert split["matmul"] == pytest.approx(2.0)
    assert split["elementwise"] == pytest.approx(0.5 + 0.2 + 0.1)  # gelu's two kernels and the copy
    assert split["attention"] == pytest.approx(1.0)
    assert split["comm in passes"] == pytest.approx(0.5)  # only what no compute hid
    assert split["dp + sync"] == pytest.approx(0.2)
    # The AdamW kernel, the host's launch of it while the device idled, the host's own AdamW.
    assert split["optimizer"] == pytest.approx(0.2 + 0.1 + 0.5)
    # The device idle: before its first kernel, from the copy to kernel_c, from kernel_c to the AdamW launch, and
    # after the host AdamW, less the loader's wait.
    assert split["framework"] == pytest.approx(1.0 + 2.9 + 0.3 + 0.5 - 0.3)
    assert split["data"] == pytest.approx(0.3)
    assert sum(split.values()) == pytest.approx(10.0)


def test_a_cp_message_sent_from_autograds_thread_is_communication_in_the_passes() -> None:
    events = [
        Event(STEP_MARK, MAIN, 0.0, 4.0),
        Event(PASSES_MARK, MAIN, 0.0, 4.0),
        # The ring attention's backward runs on autograd's device thread: its mark and send are there.
        Event(CP_MARK, AUTOGRAD, 1.0, 1.2),
        op("c10d::send", 1.0, 1.1, 1, AUTOGRAD),
        launch(1.05, 11, 1, AUTOGRAD),
        kernel("ncclDevKernel_SendRecv", 1.5, 2.0, 11, 1),
        # A pipeline stage's send, on the main thread.
        op("c10d::send", 3.0, 3.1, 2),
        launch(3.05, 12, 2),
        kernel("ncclDevKernel_SendRecv", 3.2, 3.6, 12, 2),
    ]
    split = split_device_step(events)
    assert split["comm in passes"] == pytest.approx(0.5)
    assert split["pipeline wait"] == pytest.approx(0.4)


def _function_event(name: str, device: str, id: int, start_us: float, end_us: float, **more: object) -> object:
    return SimpleNamespace(
        name=name,
        id=id,
        thread=MAIN,
        device_type=SimpleNamespace(name=device),
        time_range=SimpleNamespace(start=start_us, end=end_us),
        **more,
    )


def _kineto_event(name: str, device: str, corr: int, link: int) -> object:
    return SimpleNamespace(
        name=lambda: name,
        device_type=lambda: SimpleNamespace(name=device),
        correlation_id=lambda: corr,
        linked_correlation_id=lambda: link,
    )


def test_profile_events_links_kernels_from_the_raw_events_and_leaves_out_the_devices_annotations() -> None:
    """torch 2.11's events (the GPU machines') carry no linked id: it is read from the profiler's raw events, by
    correlation id and side (an op and a runtime call may share a number). The device's copy of a record_function
    span is no kernel."""
    events = [
        _function_event("aten::mm", "CPU", 5, 0.0, 10.0, is_user_annotation=False),
        _function_event("cudaLaunchKernel", "CPU", 5, 2.0, 3.0, is_user_annotation=False),
        _function_event("kernel_a", "CUDA", 5, 20.0, 40.0, is_user_annotation=False),
        _function_event(STEP_MARK, "CUDA", 1, 20.0, 90.0, is_user_annotation=True),
        _function_event(PASSES_MARK, "CUDA", 2, 20.0, 80.0),  # torch 2.4: no such attribute, named as ours
    ]
    raw = [
        _kineto_event("aten::mm", "CPU", 5, 0),
        _kineto_event("cudaLaunchKernel", "CPU", 5, 5),
        _kineto_event("kernel_a", "CUDA", 5, 5),
    ]
    prof = SimpleNamespace(
        events=lambda: events, profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: raw))
    )
    got = profile_events(prof)
    assert got == [
        Event("aten::mm", MAIN, 0.0, 1e-5, "cpu", 5, 0),
        Event("cudaLaunchKernel", MAIN, 2e-6, 3e-6, "cpu", 5, 5),
        Event("kernel_a", MAIN, 2e-5, 4e-5, "cuda", 5, 5),
    ]
