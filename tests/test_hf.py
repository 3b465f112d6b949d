"""ops/hf: the folder it writes is one transformers loads (shards, index, config, side files) and its key check
agrees with transformers' own model."""

import json

import pytest
import torch
from safetensors.torch import load_file

from ckpttools.io import dtypes
from ckpttools.io.safetensors_writer import OutputTensor, output_dtype
from ckpttools.io.torchfile import RecordReader
from ckpttools.layouts.registry import read_checkpoint
from ckpttools.ops import hf

from .conftest import FIXTURES

transformers = pytest.importorskip("transformers")

TRAINER = FIXTURES / "trainer_z3_gather_bf16" / "out" / "checkpoint-2"  # a tiny GPT-2 with tied embeddings


@pytest.fixture(scope="module")
def meta_model():
    model = hf.build_meta_model(TRAINER)
    assert not isinstance(model, str), model
    return model


def _trainer_shapes():
    """Keys and shapes of the weights the Trainer itself saved (save_pretrained)."""
    return {k: tuple(v.shape) for k, v in load_file(TRAINER / "model.safetensors").items()}


def _outputs(dtype=dtypes.BFLOAT16):
    ckpt = read_checkpoint(TRAINER)
    return [OutputTensor(s.name, s, output_dtype(s, dtype)) for s in ckpt.sources(dtype)]


# --- config.json ----------------------------------------------------------------------------------------


def test_load_config_tolerates_a_byte_order_mark(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xef\xbb\xbf" + (TRAINER / "config.json").read_bytes())
    assert hf.load_config(path) == json.loads((TRAINER / "config.json").read_text())


@pytest.mark.parametrize(
    "raw,why",
    [(b"\xff\xfe{}", "not UTF-8"), (b"{", "not valid JSON"), (b"[1, 2]", "JSON list"), (b"[" * 100_000, "nests")],
)
def test_load_config_refuses_unusable_files_by_name(tmp_path, raw, why):
    path = tmp_path / "config.json"
    path.write_bytes(raw)
    with pytest.raises(hf.ConfigError, match=why) as info:
        hf.load_config(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)
    assert hf.read_config(path) is None


def test_load_config_of_a_missing_file_says_so(tmp_path):
    with pytest.raises(hf.ConfigError, match="cannot read"):
        hf.load_config(tmp_path / "config.json")
    assert hf.read_config(tmp_path / "config.json") is None


def test_find_config_takes_the_given_file_or_folder_else_the_root(tmp_path):
    found = hf.find_config(tmp_path, TRAINER)
    assert found is not None and found.folder == TRAINER and found.standard_name
    assert found.side_files == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert hf.find_config(tmp_path, TRAINER / "config.json") == found
    assert hf.find_config(TRAINER) == found
    assert hf.find_config(tmp_path) is None
    with pytest.raises(hf.ConfigError, match=r"no such config\.json"):
        hf.find_config(TRAINER, tmp_path)
    other = tmp_path / "gpt2.json"
    other.write_text((TRAINER / "config.json").read_text())
    found = hf.find_config(TRAINER, other)
    assert found is not None and not found.standard_name and found.side_files == []


@pytest.mark.parametrize("dtype", [dtypes.FLOAT32, dtypes.BFLOAT16, dtypes.FLOAT16])
def test_write_config_records_the_dtype_written_as_transformers_reads_it(tmp_path, dtype):
    hf.write_config(TRAINER / "config.json", tmp_path / "config.json", dtype)
    config = transformers.AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    assert config.dtype == dtype.to_torch()
    written = json.loads((tmp_path / "config.json").read_text())
    source = json.loads((TRAINER / "config.json").read_text())
    assert {k: v for k, v in written.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in source.items() if k not in ("dtype", "torch_dtype")
    }


def test_write_config_sets_torch_dtype_only_where_it_was_or_dtype_was_not(tmp_path):
    def written(config):
        hf.write_config(config, tmp_path / "config.json", dtypes.FLOAT16)
        return json.loads((tmp_path / "config.json").read_text())

    assert written({"dtype": "float32"}) == {"dtype": "float16"}
    assert written({"torch_dtype": "float32", "dtype": "bfloat16"}) == {"torch_dtype": "float16", "dtype": "float16"}
    assert written({}) == {"torch_dtype": "float16", "dtype": "float16"}


# --- The key check against the model transformers builds ------------------------------------------------


def test_meta_model_is_what_transformers_builds(meta_model):
    config = transformers.AutoConfig.from_pretrained(TRAINER, local_files_only=True)
    real = transformers.GPT2LMHeadModel(config)
    assert meta_model.architecture == "GPT2LMHeadModel"
    assert meta_model.shapes == {k: tuple(v.shape) for k, v in real.state_dict().items()}
    assert meta_model.tied == {"lm_head.weight": "transformer.wte.weight"}


def test_the_trainers_own_weights_pass_the_key_check(meta_model):
    report = hf.compare_keys(meta_model, _trainer_shapes())
    assert report.messages("GPT2LMHeadModel") == []
    assert report.missing == []  # lm_head.weight is tied to a key the file has


def test_the_key_check_names_missing_unexpected_mismatched_and_placeholder_keys(meta_model):
    shapes = _trainer_shapes()
    del shapes["transformer.ln_f.bias"]
    shapes["transformer.extra.weight"] = (3,)
    shapes["transformer.wpe.weight"] = (31, 16)
    shapes["transformer.h.0.ln_1.weight"] = (0,)
    report = hf.compare_keys(meta_model, shapes)
    assert report.missing == ["transformer.ln_f.bias"]
    assert report.unexpected == ["transformer.extra.weight"]
    assert report.mismatched == ["transformer.wpe.weight is [31, 16], GPT2LMHeadModel expects [32, 16]"]
    assert report.placeholders == ["transformer.h.0.ln_1.weight [0]"]
    messages = report.messages("GPT2LMHeadModel")
    assert len(messages) == 4 and all("\n" not in m for m in messages)
    assert len(report.messages("GPT2LMHeadModel", ignore_missing=True)) == 3


def test_the_key_check_reports_a_config_transformers_cannot_build(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModel"], "model_type": "gpt2"}))
    assert (
        hf.build_meta_model(tmp_path)
        == "architecture NoSuchModel is not a transformers class (custom code is never run)"
    )


def test_names_shortens_long_lists():
    assert hf.names(["a", "b"]) == "a, b"
    assert hf.names("abcdef", 3) == "a, b, c, ... (6 in all)"


# --- The folder: shards, index, config and side files ---------------------------------------------------


def _save_pretrained_reference(tmp_path, max_shard_size):
    """What transformers' own save_pretrained writes for the same weights."""
    config = transformers.AutoConfig.from_pretrained(TRAINER, local_files_only=True)
    model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
    model.load_state_dict(load_file(TRAINER / "model.safetensors"), strict=False)
    out = tmp_path / "reference"
    model.save_pretrained(out, max_shard_size=max_shard_size)
    return out


def _write_folder(out, max_shard_size, fmt="safetensors"):
    tensors = _outputs()
    shards = hf.plan_shards(tensors, fmt, max_shard_size)
    config = hf.find_config(TRAINER)
    out.mkdir()
    with RecordReader() as reader:
        names = hf.write_shards(out, shards, reader, fmt=fmt)
    total_parameters = sum(t.source.numel() for t in tensors)
    files = hf.write_folder_files(
        out, shards, total_parameters=total_parameters, model_config=config, dtype=dtypes.BFLOAT16, fmt=fmt
    )
    return names, files


def test_sharded_folder_has_save_pretraineds_shards_and_index(tmp_path):
    ref = _save_pretrained_reference(tmp_path, "8KB")
    names, files = _write_folder(tmp_path / "ours", "8KB")
    theirs = json.loads((ref / "model.safetensors.index.json").read_text())
    ours = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(names) > 1 and sorted(names) == sorted(set(theirs["weight_map"].values()))
    assert ours["weight_map"] == theirs["weight_map"]
    assert ours["metadata"]["total_size"] == theirs["metadata"]["total_size"]
    assert files[0] == "model.safetensors.index.json"
    assert files[1:] == ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    for name in files[2:]:
        assert (tmp_path / "ours" / name).read_bytes() == (TRAINER / name).read_bytes()


@pytest.mark.parametrize("fmt,max_shard_size", [("safetensors", "8KB"), ("safetensors", "5GB"), ("pt", "8KB")])
def test_the_folder_loads_in_transformers_with_the_trainers_weights(tmp_path, fmt, max_shard_size):
    names, files = _write_folder(tmp_path / "ours", max_shard_size, fmt)
    assert ("model.safetensors.index.json" in files or "pytorch_model.bin.index.json" in files) == (len(names) > 1)
    model, info = transformers.GPT2LMHeadModel.from_pretrained(
        tmp_path / "ours", local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16
    expected = load_file(TRAINER / "model.safetensors")
    state = model.state_dict()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


def test_a_single_shard_needs_no_index(tmp_path):
    names, files = _write_folder(tmp_path / "ours", "5GB")
    assert names == ["model.safetensors"] and "model.safetensors.index.json" not in files
    assert not (tmp_path / "ours" / "model.safetensors.index.json").exists()


def test_copy_side_files_never_copies_config_json(tmp_path):
    copied = hf.copy_side_files(TRAINER, ["config.json", "tokenizer.json"], tmp_path)
    assert copied == ["tokenizer.json"] and not (tmp_path / "config.json").exists()
    assert (tmp_path / "tokenizer.json").read_bytes() == (TRAINER / "tokenizer.json").read_bytes()


# --- Weights a Trainer saved beside the shards ----------------------------------------------------------


def test_existing_weight_files_finds_a_single_file_or_the_indexed_shards(tmp_path):
    assert hf.existing_weight_files(TRAINER) == [TRAINER / "model.safetensors"]
    assert hf.existing_weight_files(tmp_path) == []
    ref = _save_pretrained_reference(tmp_path, "8KB")
    shards = sorted(ref.glob("model-*.safetensors"))
    assert len(shards) > 1 and hf.existing_weight_files(ref) == shards


@pytest.mark.parametrize("index", ["{", '{"no_weight_map": {}}', '{"weight_map": {"a": "../outside.safetensors"}}'])
def test_existing_weight_files_ignores_a_bad_index_or_paths_outside_the_folder(tmp_path, index):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    assert hf.existing_weight_files(tmp_path) == []


@pytest.mark.parametrize("index", ["[]", '"x"', '{"weight_map": []}', '{"weight_map": {"a": 3}}'])
def test_existing_weight_files_ignores_an_index_of_another_shape(tmp_path, index):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    assert hf.existing_weight_files(tmp_path) == []
