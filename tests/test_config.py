"""The configuration is validated as a whole before any network or model work: every bad value or combination is one
sentence and exit 2, with the Hub unreachable and without the source ever being resolved."""

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hfcompress.cli import app
from hfcompress.conversion.config import ConvertOptions, parse_size, resolve_device

runner = CliRunner()

BAD = [
    (["--max-shard-size", "banana"], "--max-shard-size 'banana' is not a size"),
    (["--max-shard-size", "12"], "is not a size"),
    (["--max-shard-size", "100B"], "smaller than 1KB"),
    (["--dtype", "float8"], "Unknown --dtype 'float8'"),
    (["--share-ratio", "2"], "--share-ratio must be in [0, 1)"),
    (["--share-ratio", "-0.1"], "--share-ratio must be in [0, 1)"),
    (["--share-ratio", "0.3", "--lisa-layers", "3,4"], "--lisa-layers and --share-ratio both choose the shared layers"),
    (["--lisa-layers", "3", "--lisa-ppl-budget", "5"], "--lisa-layers and --lisa-ppl-budget both choose"),
    (["--lisa-layers", "0,3"], "layer 0 has no layer below it"),
    (["--lisa-layers", "three"], "comma-separated layer numbers"),
    (["--lisa-ppl-budget", "0"], "--lisa-ppl-budget must be a percentage > 0"),
    (["--lisa-align", "magic"], "dense, sparse"),
    (["--lisa-align", "identity"], "Unknown --lisa-align 'identity': choose one of dense, sparse"),  # a research ablation
    (["--lisa-lowrank-keys", "kv"], "Unknown --lisa-lowrank-keys 'kv': choose one of head, group"),
    (["--qk-compression", "1"], "--qk-compression must be > 1"),
    (["--lisa-max-chain", "0"], "--lisa-max-chain must be a whole number >= 1"),
    (["--lisa-max-chain", "2", "--lisa-layers", "3,4"], "--lisa-max-chain caps the layers --share-ratio or --lisa-ppl-budget choose"),
    (["--lisa-steps", "-1"], "--lisa-steps must be a whole number >= 0"),
    (["--lisa-batch-size", "0"], "--lisa-batch-size must be a whole number >= 1"),
    (["--fasc-budget", "0"], "--fasc-budget must be in (0, 1]"),
    (["--fasc-budget", "1.5"], "--fasc-budget must be in (0, 1]"),
    (["--fasc-method", "magic"], "fisher, whiten, svd, pca"),
    (["--fasc-targets", "self_attn.q_proj"], "q_proj/k_proj are LISA's"),
    (["--fasc-rho-keep", "-1"], "--fasc-rho-keep must be >= 0"),
    (["--distill-tokens", "4096", "--kv-budget", "1.0"], "--distill-tokens trains what the conversion creates"),
    (["--distill-tokens", "100"], "is less than one step"),
    (["--distill-tokens", "0", "--distill-lora-rank", "4"], "configures distillation, which --distill-tokens 0 turns off"),
    (["--distill-tokens", "4096", "--distill-data", "web"], "Unknown --distill-data 'web': choose one of calibration, generated, mixed"),
    (["--distill-tokens", "0", "--distill-data", "generated"], "--distill-data configures distillation, which --distill-tokens 0 turns off"),
    (["--distill-tokens", "4096", "--distill-lr", "0"], "--distill-lr must be a learning rate > 0"),
    (["--distill-tokens", "4096", "--distill-seq-len", "8"], "--distill-seq-len must be a whole number >= 16"),
    (["--ood-text", "newspaper"], "--ood-text 'newspaper' is neither a file nor a text name"),
    (["--calib-sequences", "0"], "--calib-sequences must be a whole number >= 1"),
    (["--seq-len", "4"], "--seq-len must be a whole number >= 16"),
    (["--eval-tokens", "1"], "--eval-tokens must be a whole number >= 2"),
    (["--max-ppl-increase", "nan"], "--max-ppl-increase must be a finite percentage"),
    (["--calib-text", "/no/such/file.txt"], "--calib-text"),
    (["--device", "tpu"], "Unknown --device 'tpu'"),
    (["--private"], "--private only applies to a push"),
    (["--push-to", "no-namespace"], "is not a Hub repo id"),
]


@pytest.mark.parametrize("flags, needle", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_options_are_refused_before_any_work(flags, needle, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    import hfcompress.conversion.pipeline as pipeline

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("HF_TOKEN", "hf_dummy_test_token")

    def no_work(*args, **kwargs):
        raise AssertionError("the pipeline started before the options were validated")

    monkeypatch.setattr(pipeline, "convert", no_work)
    result = runner.invoke(app, ["convert", "someone/some-model", "--out", str(tmp_path / "o"), *flags])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error:") and needle in result.output, result.output
    assert not (tmp_path / "o").exists()


def test_cuda_device_refused_without_cuda(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        result = runner.invoke(app, ["convert", "someone/some-model", "--out", str(tmp_path / "o"), "--device", device])
        assert result.exit_code == 2 and "has no CUDA device" in result.output and "--device cpu" in result.output
    assert resolve_device("auto") == torch.device("cpu")


def test_cuda_device_numbering(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", process_index=3) == torch.device("cuda", 1)  # data-parallel: one device per process
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(Exception, match="has 2 CUDA device"):
        resolve_device("cuda:2")


def test_sizes_and_one_meaning_per_name():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("200KB") == 200_000 and parse_size("1.5GiB") == 3 * 2**29
    options = ConvertOptions(source="x", out=Path("unused")).validate()
    assert options.max_ppl_increase == 10.0 and options.lisa.ppl_budget is None  # the gate and the search budget
    assert options.lisa.ratio == 0.0 and options.lisa.share_ratio is None and options.keys.kv_budget == 0.75


def test_share_ratio_beyond_what_max_chain_allows_is_refused_before_calibration():
    from transformers import LlamaConfig

    from hfcompress.errors import HfcompressError
    from hfcompress.lisa import LisaOptions

    config = LlamaConfig(num_hidden_layers=8, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
    # layers 2..7 can be shared: at most 3 of them with no two in a row, 4 with at most 2 in a row
    ConvertOptions(source="x", out=Path("o"), lisa=LisaOptions(share_ratio=0.5, max_chain=2)).check_against_model(config)
    with pytest.raises(HfcompressError, match="with at most 1 in a row: raise --lisa-max-chain"):
        ConvertOptions(source="x", out=Path("o"), lisa=LisaOptions(share_ratio=0.5, max_chain=1)).check_against_model(config)


def test_convert_and_analyze_take_defaults_and_help_from_the_option_groups():
    """One home per option: a command-line option's default and help are its group's field's, in both commands."""
    import typer.main

    from hfcompress.conversion.config import DeviceOptions, DistillOptions, FascOptions, LisaOptions, TextOptions
    from hfcompress.lisa import SHOWN_SHARE_RATIO
    from hfcompress.conversion.options import option_spec

    commands = typer.main.get_command(app).commands
    convert = {p.name: p for p in commands["convert"].params}
    analyze = {p.name: p for p in commands["analyze"].params}
    for param, group, name in [
        ("protect_first", LisaOptions, "protect_first"), ("lisa_steps", LisaOptions, "steps"), ("fasc_budget", FascOptions, "budget"),
        ("distill_seq_len", DistillOptions, "seq_len"), ("seq_len", TextOptions, "seq_len"), ("device", DeviceOptions, "device"),
    ]:  # fmt: skip
        spec = option_spec(group, name)
        assert (convert[param].default, convert[param].help) == (spec.default, spec.help), param
        if param in analyze:
            assert (analyze[param].default, analyze[param].help) == (spec.default, spec.help), param
    assert analyze["share_ratio"].default == SHOWN_SHARE_RATIO > LisaOptions().ratio  # convert shares none by default
    assert convert["fasc_targets"].default == ",".join(FascOptions.targets)
