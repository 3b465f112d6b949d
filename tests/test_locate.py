"""layouts/locate: every rank file DeepSpeed wrote in the fixtures is named by exactly one pattern, and each ZeRO tag
folder's files sort into DeepSpeed's ranks."""

import pytest

from ckpttools.errors import CheckpointNotFoundError, UnsafeCheckpointError, UnsupportedCheckpointError
from ckpttools.layouts import locate

from .conftest import FIXTURES, fixture_meta, fixture_names

PATTERNS = {
    "optimizer": locate.OPTIM_RE,
    "zero3 model": locate.ZERO3_MODEL_RE,
    "model": locate.MODEL_RE,
    "pipeline layer": locate.PIPE_LAYER_RE,
    "expert": locate.EXPERT_RE,
    "expert optimizer": locate.EXPERT_OPTIM_RE,
}
CPU = [n for n in fixture_names() if not n.startswith("gpu/")]


def _tag_dirs(name):
    return sorted({p.parent for p in (FIXTURES / name).rglob("*_states.pt")})


@pytest.mark.parametrize("name", CPU)
def test_every_rank_file_deepspeed_wrote_matches_exactly_one_pattern(name):
    meta = fixture_meta(name)
    for tag_dir in _tag_dirs(name):
        for path in tag_dir.glob("*.pt"):
            hits = [kind for kind, pattern in PATTERNS.items() if pattern.match(path.name)]
            assert len(hits) == 1, (path, hits)
            m = PATTERNS[hits[0]].match(path.name)
            assert m is not None
            if "dp" in m.groupdict() and hits[0] != "expert optimizer":
                assert int(m["dp"]) < meta["dp"], path


@pytest.mark.parametrize("name", [n for n in CPU if fixture_meta(n).get("kind", "engine") in ("engine", "trainer")])
def test_zero_tag_folders_sort_into_deepspeeds_ranks(name):
    meta = fixture_meta(name)
    dp, stage = meta["dp"], meta["zero_stage"]
    for tag_dir in _tag_dirs(name):
        files = locate.classify_tag_files(sorted(p.name for p in tag_dir.iterdir()), str(tag_dir))
        assert sorted(files.optim_files) == list(range(dp))
        assert files.zero3_layout == (stage == 3)
        assert sorted(files.model_files) == (list(range(dp)) if stage == 3 else [0])
        assert files.optim_prefix == ("bf16_" if meta["dtype"] == "bf16" else "")
        for rank, file in files.optim_files.items():
            assert f"zero_pp_rank_{rank}_mp_rank_00" in file and (tag_dir / file).is_file()
        assert locate.model_parallel_ranks(files.names) == {0}


@pytest.mark.parametrize("name", ["autotp_tp2_dp2_z1_bf16", "pp2_dp2_z1_bf16"])
def test_model_parallel_ranks_are_those_of_the_files(name):
    (tag_dir,) = _tag_dirs(name)
    assert locate.model_parallel_ranks([p.name for p in tag_dir.iterdir()]) == {0, 1}


def test_tag_folders_that_are_not_zero_checkpoints_are_named():
    with pytest.raises(CheckpointNotFoundError, match=r"no \*_optim_states\.pt"):
        locate.classify_tag_files(["mp_rank_00_model_states.pt"], "t")
    with pytest.raises(CheckpointNotFoundError, match="model states only"):
        locate.classify_tag_files(["zero_pp_rank_0_mp_rank_00_model_states.pt"], "t")
    with pytest.raises(CheckpointNotFoundError, match=r"no \*_model_states\.pt"):
        locate.classify_tag_files(["zero_pp_rank_0_mp_rank_00_optim_states.pt"], "t")
    with pytest.raises(UnsupportedCheckpointError, match="NVMe"):
        locate.classify_tag_files(["offloaded_tensors", "mp_rank_00_model_states.pt"], "t")


@pytest.mark.parametrize("name", CPU)
def test_the_tag_each_latest_names_is_a_plain_folder_name(name):
    for latest in (FIXTURES / name).rglob("latest"):
        tag = latest.read_text()
        assert locate.check_tag_name(tag) == tag.strip() and (latest.parent / tag.strip()).is_dir()


@pytest.mark.parametrize("tag,plain", [("./global_step5", "global_step5"), ("global_step5/", "global_step5"),
                                       (" global_step5\n", "global_step5")])  # fmt: skip
def test_check_tag_name_gives_the_folder_deepspeed_means(tag, plain):
    assert locate.check_tag_name(tag) == plain


@pytest.mark.parametrize("tag", ["../x", "/etc", "a/b", "C:\\x", "a\\..\\..\\b", "x\x00"])
def test_check_tag_name_refuses_paths_outside_the_checkpoint(tag):
    with pytest.raises(UnsafeCheckpointError):
        locate.check_tag_name(tag)


@pytest.mark.parametrize("tag", ["", "  ", ".", "..", "x" * 256])
def test_check_tag_name_refuses_empty_or_invalid_tags(tag):
    with pytest.raises(CheckpointNotFoundError):
        locate.check_tag_name(tag)
