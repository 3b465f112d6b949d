"""layouts/rankfile: DeepSpeed's own rank files pass every typed accessor and check, and each damage is named."""

import copy

import pytest
import torch

from ckpttools.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedCheckpointError
from ckpttools.io import dtypes
from ckpttools.io.torchfile import LazyTensor, RecordReader, load_pickle
from ckpttools.layouts import rankfile as rf
from ckpttools.layouts.rankfile import RankFile

from .conftest import FIXTURES, fixture_meta

pytest.importorskip("deepspeed")  # torch.load of DeepSpeed's files needs its classes


def _tag_dir(name):
    return next((FIXTURES / name).rglob("latest")).parent / "global_step2"


def _file(name, pattern, what="model-states"):
    path = next(_tag_dir(name).glob(pattern))
    return RankFile(path, load_pickle(path), what)


def _model(name):
    return _file(name, "*mp_rank_00_model_states.pt") if "z3" in name else _file(name, "mp_rank_00_model_states.pt")


def _optims(name):
    paths = sorted(_tag_dir(name).glob("*optim_states.pt"))
    return [RankFile(p, load_pickle(p), "optimizer") for p in paths]


def _edited(f, **changes):
    return RankFile(f.path, {**copy.copy(f.obj), **changes}, f.what)


@pytest.mark.parametrize(
    "name,kind",
    [
        ("z1_dp2_bf16", "zero"),
        ("z2_dp3_fp32", "zero"),
        ("z3_dp2_bf16", "zero3"),
        ("z1_dp2_bf16_bf16opt", "bf16_optimizer"),
    ],
)
def test_deepspeeds_files_hold_every_key_deepspeed_reads_at_load(name, kind):
    model = _model(name)
    rf.require_keys(model, model.obj, rf.MODEL_KEYS, "model-states file")
    for f in _optims(name):
        rf.require_keys(f, f.obj["optimizer_state_dict"], rf.OPTIM_KEYS[kind], "optimizer file")
    with pytest.raises(CorruptCheckpointError, match="lacks 'module', 'ds_version'"):
        rf.require_keys(model, {k: v for k, v in model.obj.items() if k not in ("module", "ds_version")},
                        rf.MODEL_KEYS, "model-states file")  # fmt: skip


@pytest.mark.parametrize("name", ["z1_dp2_bf16", "z2_dp4_bf16", "z3_dp3_fp32"])
def test_accessors_read_what_torch_load_reads(name):
    meta = fixture_meta(name)
    model = _model(name)
    theirs = torch.load(model.path, weights_only=False)
    groups = rf.param_shapes_of(model, model.obj["param_shapes"], "param_shapes")
    assert groups == [[(k, tuple(v)) for k, v in g.items()] for g in theirs["param_shapes"]]
    rf.check_unique_names(model, groups)
    assert rf.dp_size_of(model) == meta["dp"] == theirs["dp_world_size"]
    for f in _optims(name):
        assert rf.zero_stage_of(f, f.obj["optimizer_state_dict"]) == meta["zero_stage"]
    mod = rf.read_module(model)
    assert mod.keys == list(theirs["module"]) == meta["state_dict_keys"]
    assert sorted(mod.buffers) == sorted(meta["buffers"])
    assert mod.shared == theirs["shared_params"]  # ZeRO-3 files record no ties
    with RecordReader() as reader:
        for n, src in mod.buffers.items():
            assert src.dtype.name == meta["buffers"][n]
            assert torch.equal(src.segments[0].tensor.load(reader), theirs["module"][n])
    train_dtype = rf.train_dtype_of(mod.tensors, [n for g in groups for n, _ in g])
    assert train_dtype.name == {"bf16": "bfloat16", "fp32": "float32"}[meta["dtype"]]


def test_optimizer_state_entries_split_into_shards_and_scalars():
    for name, step_kind in [("z2_dp2_bf16", int), ("trainer_z2_bf16", LazyTensor)]:
        f = _optims(name)[0]
        state = f.obj["optimizer_state_dict"]["base_optimizer_state"]["state"][0]
        rf.state_entries(f, state, "group 0")
        assert sorted(rf.flat_state_keys(state)) == ["exp_avg", "exp_avg_sq"]
        scalars = rf.scalar_entries(state)
        assert list(scalars) == ["step"] and isinstance(scalars["step"], step_kind)  # the Trainer's AdamW: 0-dim
    with pytest.raises(CorruptCheckpointError, match="'exp_avg' of group 0 is a str"):
        rf.state_entries(f, {**state, "exp_avg": "x"}, "group 0")
    with pytest.raises(CorruptCheckpointError, match="not a dict"):
        rf.state_entries(f, [state], "group 0")


def test_the_ranks_of_one_save_agree_and_a_changed_value_is_named():
    files = _optims("z2_dp4_bf16")
    osds = [f.obj["optimizer_state_dict"] for f in files]
    with RecordReader() as reader:
        rf.check_unsharded_agree(files, osds, rf.ZERO12_PER_RANK, reader)
        changed = [*osds[:2], {**osds[2], "clip_grad": 0.5}, osds[3]]
        with pytest.raises(CorruptCheckpointError, match=r"_2_.*disagrees with .*on clip_grad \(0\.5 vs 1\.0\)"):
            rf.check_unsharded_agree(files, changed, rf.ZERO12_PER_RANK, reader)
        ds_config = [f.obj["ds_config"] for f in files]
        deeper = [*ds_config[:3], {**ds_config[3], "zero_optimization": {"stage": 1}}]
        with pytest.raises(CorruptCheckpointError, match=r"ds_config\.zero_optimization\.stage \(1 vs 2\)"):
            rf.check_agree(files, deeper, "ds_config", reader)


def test_fingerprint_compares_small_tensors_by_their_bytes():
    a, b = _optims("trainer_z2_bf16")[:2]  # the AdamW step: a 0-dim tensor in every rank's file
    step_a = a.obj["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"]
    step_b = b.obj["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"]
    assert step_a.record.path != step_b.record.path
    with RecordReader() as reader:
        assert rf.fingerprint(step_a, reader) == rf.fingerprint(step_b, reader)
        other = a.obj["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"]
        assert rf.fingerprint(other, reader) != rf.fingerprint(step_a, reader)
    assert rf.fingerprint([float("nan"), {"a": (1,)}]) == rf.fingerprint([float("nan"), {"a": [1]}])


def test_refuse_unsupported_names_each_layout_it_cannot_read_as_plain_dp():
    rf.refuse_unsupported(_model("z2_dp2_bf16"))
    with pytest.raises(CheckpointNotFoundError, match="mp rank 1 missing"):
        rf.refuse_unsupported(_model("autotp_tp2_dp2_z1_bf16"))
    with pytest.raises(UnsupportedCheckpointError, match="MoE"):
        rf.refuse_unsupported(_model("moe_ep2_dp2_z2_bf16"))
    z2 = _model("z2_dp2_bf16")
    with pytest.raises(UnsupportedCheckpointError, match="pipeline-parallel"):
        rf.refuse_unsupported(_edited(z2, module=None))
    nvme = {**z2.obj["ds_config"], "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}
    rf.refuse_unsupported(_edited(z2, ds_config=nvme))  # NVMe offload is the ZeRO layout's to read (issue 33)
    with pytest.raises(CorruptCheckpointError, match="mp_world_size is a bool"):
        rf.refuse_unsupported(_edited(z2, mp_world_size=True))


def test_typed_accessors_name_the_file_the_key_and_the_kinds():
    f = _model("z2_dp2_bf16")
    assert rf.is_int(3) and not rf.is_int(True) and not rf.is_int(3.0)
    assert f.get(f.obj, "dp_world_size", int) == 2
    assert f.opt(f.obj, "no_such_key", int) is None
    with pytest.raises(CorruptCheckpointError, match=r"lacks 'x\.missing'") as e:
        f.get(f.obj, "missing", int, "x.")
    assert str(f.path) in str(e.value) and "re-copy" in str(e.value)
    with pytest.raises(CorruptCheckpointError, match="'ds_version' is a str, not a tensor or a dict"):
        f.get(f.obj, "ds_version", (LazyTensor, dict))
    with pytest.raises(CorruptCheckpointError, match="'ds_version' is a str, not a int"):
        f.opt(f.obj, "ds_version", int)
    with pytest.raises(CorruptCheckpointError, match="does not hold a dict"):
        RankFile(f.path, [], "model-states")
    counts = f.obj["module"]["counts"]  # an int64 buffer
    assert f.tensor(counts, "counts", floating=False) is counts
    with pytest.raises(CorruptCheckpointError, match="stored as int64, not a floating-point"):
        f.tensor(counts, "counts")
    with pytest.raises(CorruptCheckpointError, match="is a int, not a tensor"):
        f.tensor(3, "x")
    weight = f.obj["module"]["fc1.weight"]
    with pytest.raises(CorruptCheckpointError, match="stored as bfloat16, not float32"):
        f.master(weight, "fc1.weight")
    master = _optims("z2_dp2_bf16")[0].obj["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    assert f.master(master, "partition").dtype == dtypes.FLOAT32


def test_shapes_and_nested_configs():
    f = _model("z2_dp2_bf16")
    assert rf.shape_of(f, [3, 0, 2], "s") == (3, 0, 2) and rf.shape_of(f, (), "s") == ()
    for bad in ([3, -1], [True], "34", [2.0]):
        with pytest.raises(CorruptCheckpointError, match="is not a shape"):
            rf.shape_of(f, bad, "s")
    with pytest.raises(CorruptCheckpointError, match="not a list of dicts"):
        rf.param_shapes_of(f, {"a": [1]}, "param_shapes")
    with pytest.raises(CorruptCheckpointError, match="lists a twice"):
        rf.check_unique_names(f, [[("a", (1,))], [("module.a", (1,))]])
    assert rf.dict_at({"a": {"b": {"c": 1}}}, "a", "b") == {"c": 1}
    assert rf.dict_at({"a": {"b": 3}}, "a", "b") == {} and rf.dict_at(None, "a") == {}


def test_read_module_refuses_damaged_modules():
    f = _model("z2_dp2_bf16")
    module = f.obj["module"]
    with pytest.raises(CorruptCheckpointError, match="collide after stripping"):
        rf.read_module(_edited(f, module={**module, "module.scale": module["scale"]}))
    with pytest.raises(CorruptCheckpointError, match="module entry scale is a int"):
        rf.read_module(_edited(f, module={**module, "scale": 1}))
    with pytest.raises(CorruptCheckpointError, match="buffer_names lists nothing"):
        rf.read_module(_edited(f, buffer_names=[*f.obj["buffer_names"], "nothing"]))


def test_undeclared_aliases_find_entries_sharing_storage():
    f = _model("z2_dp2_bf16")  # head.weight is tied to emb.weight and declared in shared_params
    mod = rf.read_module(f)
    params = dict.fromkeys(["emb.weight", "fc1.weight"])
    assert rf.undeclared_aliases(mod, params) == {}
    del mod.shared["head.weight"]
    assert rf.undeclared_aliases(mod, params) == {"head.weight": "emb.weight"}
