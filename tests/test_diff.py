"""`ckpt diff`: the same model in two formats is identical, what changed is found and located, and the exit code
says same (0), different (1) or could not compare (2). Every number is checked against torch on loaded tensors."""

import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ckpttools.cli import main
from ckpttools.ops.consolidate import consolidate
from ckpttools.ops.diff import diff

from .conftest import FIXTURES

PEFT = ["peft_engine_z2_bf16", "peft_trainer_z2_bf16"]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def run_json(*args):
    result = run(*args, "--json")
    return result.exit_code, json.loads(result.stdout) if result.stdout.strip() else None, result


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["z3_dp2_bf16", "trainer_z3_gather_bf16"])
def test_a_zero3_checkpoint_and_its_consolidated_folder_are_identical(name, dtype, tmp_path):
    ckpt = FIXTURES / name / ("out/checkpoint-2" if name.startswith("trainer") else "checkpoint")
    consolidate(ckpt, tmp_path / "model", dtype=dtype)
    code, d, _ = run_json("diff", ckpt, tmp_path / "model")  # dtype taken from the folder
    assert code == 0, d
    assert d["same"] and d["counts"]["identical"] == d["a"]["num_tensors"] and d["tensors"] == []
    assert d["a"]["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    code, d, _ = run_json("diff", tmp_path / "model", ckpt)  # either way round
    assert code == 0 and d["same"]


def test_a_dcp_folder_and_accelerates_merge_are_identical():
    name = FIXTURES / "accelerate_fsdp2_sharded"
    code, d, _ = run_json("diff", name / "checkpoint", name / "reference" / "model.safetensors")
    assert code == 0
    assert d["counts"]["identical"] == 21 and d["same"]


@pytest.mark.parametrize(
    ("name", "reference"),
    [
        ("fsdp2_hf_safetensors", "consolidated"),  # torch's consolidate_safetensors_files of the HF-shard DCP save
        ("fsdp2_dcp_dp3_bf16", "live_full_state.safetensors"),  # get_model_state_dict(full_state_dict=True)
        ("fsdp2_tp2_dp2", "live_full_state.safetensors"),  # FSDP2 x tensor parallel
        ("accelerate_fsdp2_rankfiles", "live_full_state.safetensors"),  # per-rank DTensor .bin files
    ],
)
def test_dcp_folders_and_their_references_are_identical(name, reference):
    code, d, _ = run_json("diff", FIXTURES / name / "checkpoint", FIXTURES / name / "reference" / reference)
    assert code == 0, d
    assert d["counts"]["identical"] == d["b"]["num_tensors"] and d["tensors"] == []


@pytest.mark.parametrize(
    "name",
    ["z0_dp2_bf16", "z1_dp3_bf16", "z2_dp4_bf16", "z3_dp3_bf16", "pp2_dp2_z1_bf16", "pp2_tp2_dp1_z1_bf16_megatron",
     "moe_ep2_dp2_z2_bf16", "muon_z3_dp2_bf16", "keep_fp32_z3_bf16", "legacy_z2_dp2_bf16", "nvme_z3_dp2_bf16",
     "lightning_z3_bf16", "peft_engine_z3_bf16", "trainer_z2_bf16"],
)  # fmt: skip
def test_a_checkpoint_is_identical_to_the_engines_own_16bit_state_dict(name):
    """reference/bit16.safetensors is what the live engine gave (module_state_dict at ZeRO-1/2, the gathered
    16-bit state dict at ZeRO-3): diff takes the checkpoint's bf16 weights from it (the file's dtype) and finds
    every tensor bit-identical, whatever the layout."""
    ckpt = FIXTURES / name / "checkpoint"
    if not ckpt.is_dir():
        ckpt = max((FIXTURES / name / "out").glob("checkpoint-*"))
    code, d, _ = run_json("diff", ckpt, FIXTURES / name / "reference" / "bit16.safetensors")
    assert code == 0, d
    assert d["a"]["dtype"] == "bfloat16" and d["counts"]["identical"] == d["b"]["num_tensors"]


def test_one_accelerate_run_saved_two_ways_is_identical():
    """accelerate's SHARDED_STATE_DICT DCP folder and its use_dcp=False per-rank DTensor files of the same run."""
    code, d, _ = run_json("diff", FIXTURES / "accelerate_fsdp2_sharded" / "checkpoint",
                          FIXTURES / "accelerate_fsdp2_rankfiles" / "checkpoint")  # fmt: skip
    assert code == 0 and d["counts"]["identical"] == 21


@pytest.mark.parametrize("name", PEFT)
def test_a_peft_merge_against_its_base_reports_exactly_the_changed_tensors(name):
    base, merged = FIXTURES / name / "base", FIXTURES / name / "reference" / "merged_fp32.safetensors"
    code, d, _ = run_json("diff", base, merged)
    theirs, ours = load_file(base / "model.safetensors"), load_file(merged)
    changed = {k for k in theirs if not torch.equal(theirs[k], ours[k])}
    assert changed  # the merge changed the adapted weights
    assert code == 1 and not d["same"]
    assert {t["name"] for t in d["tensors"] if t["status"] == "changed"} == changed
    assert d["counts"]["identical"] == len(ours) - len(changed)  # lm_head.weight: compared with the tied wte
    for t in d["tensors"]:
        a, b = theirs[t["name"]].double(), ours[t["name"]].double()
        assert t["differing"] == int((a != b).sum())
        assert t["max_abs_diff"] == pytest.approx(float((a - b).abs().max()), rel=1e-12)
        rel = float((b - a).norm() / a.norm())  # inf where A is all zeros (JSON says "inf")
        assert t["rel_l2"] == ("inf" if math.isinf(rel) else pytest.approx(rel, rel=1e-9))


def test_one_flipped_element_is_found_and_located(tmp_path):
    src = FIXTURES / "peft_engine_z2_bf16" / "base"
    shutil.copytree(src, tmp_path / "b")
    state = load_file(src / "model.safetensors")
    name = "transformer.h.1.mlp.c_proj.weight"
    state[name][17, 3] = -state[name][17, 3]
    save_file(state, tmp_path / "b" / "model.safetensors", metadata={"format": "pt"})
    code, d, _ = run_json("diff", src, tmp_path / "b")
    assert code == 1
    (t,) = d["tensors"]
    a = load_file(src / "model.safetensors")[name]
    assert (t["name"], t["status"], t["differing"], t["first"]) == (name, "changed", 1, [17, 3])
    assert t["first_values"] == [float(a[17, 3]), -float(a[17, 3])]
    assert t["max_abs_diff"] == pytest.approx(2 * abs(float(a[17, 3])))
    human = run("diff", src, tmp_path / "b")
    assert human.exit_code == 1
    assert "transformer.h.1" in human.stdout and "mlp.c_proj.weight" in human.stdout and "[17, 3]" in human.stdout


def test_tolerances_nan_shapes_dtypes_and_names(tmp_path):
    base = {"w": torch.randn(5, 4), "n": torch.tensor([1.0, float("nan"), 2.0]), "z": torch.zeros(3),
            "s": torch.ones(2, 3), "d": torch.ones(4), "only_a": torch.ones(1), "i": torch.arange(6)}  # fmt: skip
    other = {k: v.clone() for k, v in base.items() if k != "only_a"}
    other["w"][2, 1] += 1e-6
    other["z"][1] = -0.0  # equal values, other bits
    other["s"] = torch.ones(3, 2)
    other["d"] = torch.ones(4, dtype=torch.bfloat16)
    other["only_b"] = torch.zeros(2)
    save_file(base, tmp_path / "a.safetensors")
    save_file(other, tmp_path / "b.safetensors")
    r = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    status = {t.name: t.status for t in r.tensors}
    assert status == {"w": "changed", "n": "identical", "z": "equal", "s": "shape", "d": "dtype",
                      "only_a": "only_in_a", "i": "identical", "only_b": "only_in_b"}  # fmt: skip
    w = next(t for t in r.tensors if t.name == "w")
    assert w.first == [2, 1] and w.differing == 1
    d = next(t for t in r.tensors if t.name == "d")
    assert d.differing == 0  # the values are equal; the dtype is not
    loose = diff(tmp_path / "a.safetensors", tmp_path / "b.safetensors", atol=1e-5)
    assert next(t for t in loose.tensors if t.name == "w").status == "equal"


def test_nan_against_a_number_differs_with_an_infinite_distance(tmp_path):
    save_file({"x": torch.tensor([1.0, 2.0, 3.0])}, tmp_path / "a.safetensors")
    save_file({"x": torch.tensor([1.0, float("nan"), 3.0])}, tmp_path / "b.safetensors")
    code, d, _ = run_json("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    assert code == 1
    (t,) = d["tensors"]
    assert t["differing"] == 1 and t["first"] == [1] and t["max_abs_diff"] == "inf" and t["rel_l2"] == "inf"
    assert t["first_values"][0] == 2.0 and math.isnan(float(t["first_values"][1]))


def test_within_tolerance_is_the_same(tmp_path):
    save_file({"x": torch.tensor([1.0, 2.0])}, tmp_path / "a.safetensors")
    save_file({"x": torch.tensor([1.0, 2.0001])}, tmp_path / "b.safetensors")
    assert run("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors").exit_code == 1
    result = run("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--rtol", "1e-4")
    assert result.exit_code == 0 and "equal within" in result.stdout


def test_a_damaged_rank_file_cannot_be_compared_exit_2(tmp_path):
    """A flipped byte fails its CRC-32: "could not compare" (2), never "different" (1)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "z2_dp2_bf16" / "checkpoint", ckpt)
    from ckpttools.layouts.registry import open_checkpoint

    segment = open_checkpoint(ckpt).params[-1].fp32.segments[-1]  # a byte of an fp32 master partition
    record, rank = segment.tensor.record, segment.tensor.record.path
    data = bytearray(rank.read_bytes())
    data[record.offset + record.nbytes - 3] ^= 0x10
    rank.write_bytes(data)
    result = run("diff", FIXTURES / "z2_dp2_bf16" / "checkpoint", ckpt)
    assert result.exit_code == 2, result.output
    assert "CRC-32" in result.stderr and result.stderr.startswith("Error: ")
    code, d, _ = run_json("diff", FIXTURES / "z2_dp2_bf16" / "checkpoint", ckpt)
    assert code == 2 and d["error"]["exit_code"] == 2 and "CRC-32" in d["error"]["message"]  # the JSON says 2 too


def test_a_bug_or_a_system_error_is_could_not_compare_never_different(monkeypatch, tmp_path):
    import ckpttools.ops.diff as diff_module

    def broken(*args, **kwargs):
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(diff_module, "diff", broken)
    result = run("diff", tmp_path, tmp_path)
    assert result.exit_code == 2 and "internal error (RuntimeError: something unforeseen)" in result.stderr

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device", "/tmp/x")

    monkeypatch.setattr(diff_module, "diff", no_space)
    result = run("diff", tmp_path, tmp_path)
    assert result.exit_code == 2 and "No space left on device: /tmp/x" in result.stderr


def test_usage_and_missing_paths_exit_2(tmp_path):
    assert run("diff", tmp_path / "nothing", FIXTURES / "z2_dp2_bf16" / "checkpoint").exit_code == 2
    assert run("diff", "a", "b", "--atol", "-1").exit_code == 2
    assert run("diff", "a").exit_code == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run("diff", empty, FIXTURES / "z2_dp2_bf16" / "checkpoint")
    assert result.exit_code == 2 and result.stderr.startswith("Error: ")


def test_two_training_checkpoints_compare_their_fp32_masters(tmp_path):
    """ZeRO-2 and ZeRO-3 runs of the same toy model differ; the same run read twice does not."""
    z2 = FIXTURES / "z2_dp2_bf16" / "checkpoint"
    assert run("diff", z2, z2).exit_code == 0
    code, d, _ = run_json("diff", z2, FIXTURES / "z3_dp2_bf16" / "checkpoint")
    assert d["a"]["dtype"] == "float32" and d["b"]["dtype"] == "float32"
    assert code == (0 if d["same"] else 1)


def test_two_s3_checkpoints_compared_by_byte_range(tmp_path, monkeypatch):
    """A ZeRO-3 checkpoint and its consolidated folder, both on S3 (moto), read side by side: identical; a changed
    element in a third copy is found, exit 1."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from ckpttools.io import remote
    from tests.support.s3_server import LocalS3

    ckpt = FIXTURES / "z3_dp2_bf16" / "checkpoint"
    consolidate(ckpt, tmp_path / "model", dtype="bf16")
    changed = tmp_path / "changed"
    shutil.copytree(tmp_path / "model", changed)
    state = load_file(changed / "model.safetensors")
    state["fc2.weight"][3, 4] += 1
    save_file(state, changed / "model.safetensors", metadata={"format": "pt"})
    with LocalS3() as s3:
        s3.put_folder(ckpt, "bucket", "run/checkpoint-2")
        s3.put_folder(tmp_path / "model", "bucket", "model")
        s3.put_folder(changed, "bucket", "changed")
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv(remote.MOUNTS_VAR, raising=False)
        try:
            code, d, result = run_json("diff", "s3://bucket/run/checkpoint-2", "s3://bucket/model")
            assert code == 0, result.output
            assert d["same"] and d["a"]["path"] == "s3://bucket/run/checkpoint-2" and d["a"]["dtype"] == "bfloat16"
            code, d, result = run_json("diff", "s3://bucket/model", "s3://bucket/changed")
            assert code == 1, result.output
            assert [(t["name"], t["first"]) for t in d["tensors"]] == [("fc2.weight", [3, 4])]
            assert run("diff", "s3://bucket/model", "s3://bucket/nothing").exit_code == 2
        finally:
            remote.cleanup()


def test_a_megatron_checkpoint_is_compared_under_hugging_face_names(tmp_path):
    """The adapter consolidate applies (Megatron-Core -> Llama) names the checkpoint's side too."""
    ckpt = FIXTURES / "megatron_tp2_llama" / "checkpoint"
    consolidate(ckpt, tmp_path / "model")
    code, d, _ = run_json("diff", ckpt, tmp_path / "model")
    assert code == 0, d
    assert d["counts"]["identical"] == d["b"]["num_tensors"]
    assert any("megatron-core -> LlamaForCausalLM" in n for n in d["notes"])


def test_a_torch_save_folder_and_file(tmp_path):
    """consolidate --to pt's pytorch_model.bin (read through the pickle allowlist, never loaded) is identical to
    the checkpoint; a state dict holding a strided view cannot be compared (exit 2, one line)."""
    ckpt = FIXTURES / "z2_dp2_bf16" / "checkpoint"
    consolidate(ckpt, tmp_path / "pt", to="pt")
    code, d, _ = run_json("diff", ckpt, tmp_path / "pt")
    assert code == 0 and d["b"]["description"] == "weights folder (pytorch_model.bin)"
    a = torch.randn(3, 4)
    torch.save({"a": a, "view": a[:, 1]}, tmp_path / "views.pt")
    result = run("diff", tmp_path / "views.pt", tmp_path / "pt" / "pytorch_model.bin")
    assert result.exit_code == 2 and "strided view" in result.stderr


def test_optimizer_states_of_a_resharded_checkpoint_and_a_planted_change(tmp_path):
    """--optimizer-states: a DP 2 -> DP 3 reshard and a universal checkpoint keep every moment bit for bit; a value
    changed in rank 0's exp_avg_sq (torch.load / torch.save of the real rank file) is that one state of that one
    parameter."""
    from ckpttools.ops.reshard import reshard

    src = FIXTURES / "z2_dp2_bf16" / "checkpoint"
    reshard(src, tmp_path / "dp3", dp=3)
    reshard(src, tmp_path / "universal", universal=True)
    for resharded in ("dp3", "universal"):
        code, d, _ = run_json("diff", src, tmp_path / resharded, "--optimizer-states")
        assert code == 0 and d["counts"]["identical"] == 12 + 14  # 12 weights, 7 parameters x 2 moments
    planted = tmp_path / "planted"
    shutil.copytree(src, planted)
    rank0 = planted / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = torch.load(rank0, map_location="cpu", weights_only=False)
    state["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg_sq"][0] *= 2
    torch.save(state, rank0)
    assert run("diff", src, planted).exit_code == 0  # the weights are the same
    code, d, _ = run_json("diff", src, planted, "--optimizer-states")
    assert code == 1
    assert [(t["name"], t["what"], t["differing"], t["first"]) for t in d["tensors"]] == [
        ("emb.weight", "exp_avg_sq", 1, [0, 0])
    ]
    consolidate(src, tmp_path / "model")
    result = run("diff", src, tmp_path / "model", "--optimizer-states")  # a weights folder has no optimizer
    assert result.exit_code == 2 and "two training checkpoints" in result.stderr


def test_a_damaged_trainer_checkpoint_is_not_replaced_by_the_weights_beside_it(tmp_path):
    """A Trainer checkpoint holds model.safetensors beside its shards: with a rank file missing, diff says so (exit
    2) instead of comparing the 16-bit weights file and answering "same"."""
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(FIXTURES / "trainer_z3_gather_bf16" / "out" / "checkpoint-2", ckpt)
    next((ckpt / "global_step2").glob("*rank_1*optim_states.pt")).unlink()
    result = run("diff", ckpt, FIXTURES / "trainer_z3_gather_bf16" / "out" / "checkpoint-2" / "model.safetensors")
    assert result.exit_code == 2 and "rank 1 missing" in result.stderr, result.output
    assert run("stats", ckpt).exit_code == 1


def test_a_hub_repo_against_the_checkpoint_it_was_trained_from(tmp_path, monkeypatch):
    """ "Is the model on the Hub the one I trained?": hf://org/model (the Hub test server) against the local ZeRO-3
    checkpoint, in the model's dtype; then a repo holding one changed element."""
    from huggingface_hub import HfApi, constants

    from ckpttools.io import remote
    from tests.support.hub_server import LocalHub

    ckpt = FIXTURES / "z3_dp2_bf16" / "checkpoint"
    consolidate(ckpt, tmp_path / "model", dtype="bf16")
    state = load_file(tmp_path / "model" / "model.safetensors")
    state["fc1.bias"][5] += 1
    (tmp_path / "changed").mkdir()
    save_file(state, tmp_path / "changed" / "model.safetensors", metadata={"format": "pt"})
    token = "hf_local_test_token"
    with LocalHub(token=token) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_TOKEN", token)
        monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv(remote.MOUNTS_VAR, raising=False)
        api = HfApi(endpoint=hub.url, token=token)
        for repo, folder in (("org/model", tmp_path / "model"), ("org/changed", tmp_path / "changed")):
            api.create_repo(repo)
            api.upload_folder(folder_path=folder, repo_id=repo)
        try:
            code, d, result = run_json("diff", ckpt, "hf://org/model")
            assert code == 0, result.output
            assert d["b"]["path"] == "hf://org/model" and d["a"]["dtype"] == "bfloat16"
            code, d, result = run_json("diff", "hf://org/model", "hf://org/changed")
            assert code == 1, result.output
            assert [(t["name"], t["first"]) for t in d["tensors"]] == [("fc1.bias", [5])]
        finally:
            remote.cleanup()
