from pathlib import Path

import pytest

from ckpttools.errors import CheckpointNotFoundError, CkptError, UnsafeCheckpointError, UnsupportedCheckpointError
from ckpttools.layouts.locate import check_tag_name, classify_tag_files
from ckpttools.layouts.registry import detect_layout, locate

ZERO3 = [
    "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "zero_pp_rank_0_mp_rank_00_model_states.pt",
    "zero_pp_rank_1_mp_rank_00_model_states.pt",
]
ZERO2 = [
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "mp_rank_00_model_states.pt",
]


def test_classify_zero3_and_zero2_names():
    z3 = classify_tag_files(ZERO3)
    assert z3.zero3_layout and z3.optim_prefix == "bf16_" and sorted(z3.model_files) == [0, 1]
    z2 = classify_tag_files(ZERO2)
    assert not z2.zero3_layout and z2.optim_prefix == "" and z2.model_files == {0: "mp_rank_00_model_states.pt"}


def test_legacy_optim_name_without_underscore_is_read():
    files = classify_tag_files(["zero_pp_rank_0_mp_rank_00optim_states.pt", "mp_rank_00_model_states.pt"])
    assert files.optim_files == {0: "zero_pp_rank_0_mp_rank_00optim_states.pt"}


PIPE = [
    "layer_00-model_states.pt",
    "layer_03-model_states.pt",
    "mp_rank_00_model_states.pt",
    "mp_rank_01_model_states.pt",
    "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt",
]
TP = [
    "mp_rank_00_model_states.pt",
    "mp_rank_01_model_states.pt",
    *(f"bf16_zero_pp_rank_{dp}_mp_rank_0{tp}_optim_states.pt" for dp in (0, 1) for tp in (0, 1)),
]


@pytest.mark.parametrize(
    "names,layout",
    [
        (ZERO2, "dp"),
        (ZERO3, "dp"),
        (PIPE, "pipeline"),
        ([*ZERO2, "layer_01-model_00-model_states.pt"], "pipeline_tp"),  # Megatron-DeepSpeed 3D
        (TP, "tensor"),
        ([*ZERO2, "layer_0_expert_3_mp_rank_00_model_states.pt"], "moe"),
        ([*ZERO2, "expp_rank_0_mp_rank_00_optim_states.pt"], "moe"),
        (["mp_rank_00_model_states.pt"], "zero0"),
    ],
)
def test_layout_is_told_by_the_file_names(names, layout):
    kind = detect_layout(names).kind
    files = classify_tag_files(names, layout=kind)
    assert kind == layout and files.layout == layout and files.names == tuple(names)


def test_files_of_other_stages_or_tp_ranks_are_not_duplicates():
    """Advice to delete mp_rank_01 files would destroy a pipeline or tensor-parallel checkpoint."""
    for names in (PIPE, TP):
        files = classify_tag_files(names, layout=detect_layout(names).kind)
        assert files.optim_files == {int(n.split("_")[4]): n for n in names if "optim" in n and "mp_rank_00" in n}


def test_nvme_offload_is_read_as_data_parallel_and_refused_by_name_elsewhere():
    assert classify_tag_files([*ZERO2, "offloaded_tensors"]).optim_files  # the ZeRO layout reads swap files
    with pytest.raises(UnsupportedCheckpointError, match="NVMe"):
        classify_tag_files([*ZERO2, "offloaded_tensors"], layout="moe")


def test_no_optimizer_files_is_not_a_zero_tag():
    with pytest.raises(CheckpointNotFoundError, match=r"no \*_optim_states\.pt"):
        classify_tag_files(["zero_pp_rank_0_mp_rank_00_model_states.pt"])


def test_mixed_prefixes_are_refused():
    with pytest.raises(CkptError, match="prefixes"):
        classify_tag_files([*ZERO2, "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt"])


@pytest.mark.parametrize("tag", ["../etc", "/abs", "a/b", "..", "C:\\x", "a\\..\\b"])
def test_tags_that_escape_the_folder_are_refused(tag):
    with pytest.raises((UnsafeCheckpointError, CheckpointNotFoundError)):
        check_tag_name(tag)


def test_tag_whitespace_from_latest_is_stripped():
    assert check_tag_name("global_step2\n") == "global_step2"


def _fake_tag(root: Path, tag: str = "global_step2") -> None:
    (root / tag).mkdir(parents=True)
    for name in ZERO2:
        (root / tag / name).write_bytes(b"")


def test_locate_reads_latest_and_accepts_the_tag_folder_itself(tmp_path):
    _fake_tag(tmp_path)
    (tmp_path / "latest").write_text("global_step2")
    assert locate(tmp_path).tag == "global_step2"
    loc = locate(tmp_path / "global_step2")
    assert loc.root == tmp_path and loc.tag == "global_step2"


def test_locate_without_latest_lists_the_tags(tmp_path):
    _fake_tag(tmp_path, "global_step7")
    with pytest.raises(CheckpointNotFoundError, match=r"no `latest`.*global_step7"):
        locate(tmp_path)
    assert locate(tmp_path, tag="global_step7").tag == "global_step7"


def test_locate_unknown_tag_and_escaping_latest(tmp_path):
    _fake_tag(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="tag 'global_step9'"):
        locate(tmp_path, tag="global_step9")
    (tmp_path / "latest").write_text("../../etc")
    with pytest.raises(UnsafeCheckpointError):
        locate(tmp_path)


def test_trainer_output_dir_picks_newest_step_or_best(tmp_path):
    for step in (5, 10):
        _fake_tag(tmp_path / f"checkpoint-{step}")
        (tmp_path / f"checkpoint-{step}" / "latest").write_text("global_step2")
    (tmp_path / "checkpoint-10" / "trainer_state.json").write_text(
        '{"best_model_checkpoint": "out/checkpoint-5", "log_history": []}'
    )
    assert locate(tmp_path).root.name == "checkpoint-10"
    assert locate(tmp_path, step=5).root.name == "checkpoint-5"
    assert locate(tmp_path, best=True).root.name == "checkpoint-5"
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint-7; found steps \\[5, 10\\]"):
        locate(tmp_path, step=7)


def test_plain_weights_folder_is_explained(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(CkptError, match="already holds plain weights"):
        locate(tmp_path)


def test_missing_path_and_file_path(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        locate(tmp_path / "nope")
    (tmp_path / "f").write_text("")
    with pytest.raises(CheckpointNotFoundError, match="is a file"):
        locate(tmp_path / "f")


def test_lightning_checkpoint_folders_are_found(tmp_path):
    """ModelCheckpoint with DeepSpeedStrategy writes `<name>.ckpt/` save_dirs into its dirpath."""
    import shutil

    from .conftest import FIXTURES

    src = FIXTURES / "lightning_z2_bf16" / "checkpoint" / "epoch=0-step=2.ckpt"
    if not src.is_dir():
        pytest.skip("lightning fixture not built")
    shutil.copytree(src, tmp_path / "epoch=0-step=2.ckpt")
    assert locate(tmp_path).root == tmp_path / "epoch=0-step=2.ckpt"
    shutil.copytree(src, tmp_path / "last.ckpt")
    with pytest.raises(CkptError, match=r"holds 2 Lightning checkpoints .*pass the one to read"):
        locate(tmp_path)
