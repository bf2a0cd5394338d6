"""Engram tables in host memory: the step's rows gathered (on a worker thread, copied on a side
stream) read exactly what the device table reads, and where tables go by default."""

from __future__ import annotations

import pytest
import torch

from deepinfer import kernels
from deepinfer.engine.model import engram
from deepinfer.engine.model.engram import EngramTable, engram_on_host


def _random_table(rows: int, width: int, host: bool, device=None) -> EngramTable:
    table = EngramTable(rows, width, True, torch.bfloat16, device=device, host=host)
    table.weight.data.copy_((torch.randn(rows, width) * 3).to(torch.float8_e4m3fn))
    scales = torch.randint(118, 136, (rows, width // 32), dtype=torch.uint8)
    table.scale.data.copy_(scales.view(torch.float8_e8m0fnu))
    return table


def test_the_gathered_rows_read_exactly_what_the_whole_table_reads():
    torch.manual_seed(0)
    table = _random_table(5000, 64, host=True)
    row_ids = torch.randint(0, 5000, (37, 6))
    row_ids[3] = row_ids[5]  # repeated rows
    weight, scale, local = table.gather(row_ids)
    assert weight.shape[0] == torch.unique(row_ids).numel() < row_ids.numel()
    want = kernels.engram_embedding_lookup(table.weight, table.scale, row_ids)
    got = kernels.engram_embedding_lookup(weight, scale, local)
    assert torch.equal(got, want)


def test_tables_stay_on_the_device_off_cuda_and_when_forced(monkeypatch):
    assert not engram_on_host("cpu", 1 << 40)
    assert not engram_on_host(None, 1 << 40)
    if torch.cuda.is_available():
        assert engram_on_host("cuda", 1 << 50)
        assert not engram_on_host("cuda", 1 << 10)
        monkeypatch.setenv("DEEPINFER_ENGRAM_FORCE_GPU_STORAGE", "1")
        assert not engram_on_host("cuda", 1 << 50)


def test_a_host_table_on_the_cpu_reads_its_rows_directly():
    table = _random_table(300, 32, host=True)
    row_ids = torch.randint(0, 300, (9, 4))
    table.prefetch(row_ids)  # nothing to prefetch off the GPU
    want = kernels.engram_embedding_lookup(table.weight, table.scale, row_ids)
    assert torch.equal(table(row_ids, torch.bfloat16), want)


@pytest.mark.parametrize("prefetched", [True, False], ids=["prefetched", "on-demand"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_host_table_equals_the_device_table_on_the_gpu(prefetched):
    torch.manual_seed(1)
    host = _random_table(200_000, 256, host=True)
    assert host.weight.is_pinned() and not host.weight.is_cuda
    device = EngramTable(200_000, 256, True, torch.bfloat16, device="cuda")
    device.weight.data.copy_(host.weight.data)
    device.scale.data.copy_(host.scale.data)
    for _ in range(3):  # fresh rows each step, produced on the device as the hasher's are
        row_ids = torch.randint(0, 200_000, (512, 24), device="cuda")
        if prefetched:
            host.prefetch(row_ids)
        got = host(row_ids, torch.bfloat16)
        assert torch.equal(got, device(row_ids, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_v41_model_with_host_tables_gives_the_device_tables_logits(monkeypatch):
    from deepinfer.engine.model.config_parsing import parse_config
    from deepinfer.engine.model.model import build_model
    from deepinfer.engine.runner.cuda_graphs import DecodeGraphs
    from deepinfer.engine.testing.simple_runner import SimpleRunner

    from .test_v41_invariants import RAW, TEXT, VOCAB  # noqa: TID252

    logits = {}
    for share in (0.0, 1.0):  # every table on the host / every table on the device
        monkeypatch.setattr(engram, "HOST_TABLE_SHARE", share)
        model = build_model(parse_config(RAW), device="cuda", dtype=torch.float32)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for _, t in sorted(model.state_dict().items()):
                t.copy_(0.3 * torch.randn(t.shape, generator=gen))
        vocab = TEXT["engram_compressed_vocab_size"]
        model.bind_engram(torch.randint(0, vocab, (VOCAB,), generator=gen))
        hosted = any(isinstance(m, EngramTable) and m.host for m in model.modules())
        assert hosted == (share == 0.0)
        if hosted:
            assert not DecodeGraphs.supports(model, torch.device("cuda"))
        runner = SimpleRunner(model.eval(), max_seqs=2, max_len=64, device="cuda")
        prompts = {0: torch.randint(3, VOCAB, (40,), generator=gen).tolist(), 1: [4, 4, 8]}
        steps = [runner.step(prompts)]
        for _ in range(4):
            steps.append(runner.step({s: [int(o[-1].argmax())] for s, o in steps[-1].items()}))
        logits[share] = [{s: o.cpu() for s, o in step.items()} for step in steps]
    for host_step, device_step in zip(logits[0.0], logits[1.0], strict=True):
        for seq in host_step:
            assert torch.equal(host_step[seq], device_step[seq])
