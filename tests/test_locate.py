"""layouts/locate: every rank file DeepSpeed wrote in the fixtures is named by exactly one pattern, and each ZeRO tag
folder's files sort into DeepSpeed's ranks."""

import shutil

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
        locate.classify_tag_files(["offloaded_tensors", "mp_rank_00_model_states.pt"], "t", layout="pipeline")


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


# --------------------------------------------------------------------------------------------------
# --step, --best and --tag: honoured, or refused as a usage error naming why; never ignored (issue 35 item 1)
# --------------------------------------------------------------------------------------------------

TRAINER = FIXTURES / "trainer_z2_bf16" / "out"
DCP_RUN = FIXTURES / "fsdp2_dcp_dp2_fp32" / "checkpoint"


def _refused(match, path, **selection):
    from ckpttools.errors import SelectionError, UsageError
    from ckpttools.layouts.registry import checkpoint_root

    with pytest.raises(SelectionError, match=match) as e:
        checkpoint_root(path, **selection)
    assert isinstance(e.value, UsageError) and e.value.exit_code == 2


def test_a_step_other_than_the_one_path_names_is_refused_not_ignored():
    """checkpoint-2 --step 1 read step 2, exit 0; the same for an FSDP2 step-2 folder with --step 9."""
    from ckpttools.layouts.registry import checkpoint_root

    _refused(r"--step 1 cannot apply: .*checkpoint-2 is one checkpoint \(step 2\).* --step 1", TRAINER / "checkpoint-2",
             step=1)  # fmt: skip
    assert checkpoint_root(TRAINER / "checkpoint-2", step=2) == (TRAINER / "checkpoint-2", "global_step2")
    _refused(r"--step 9 cannot apply: .*step-2 is one torch DCP folder \(step 2\)", DCP_RUN / "step-2", step=9)
    assert checkpoint_root(DCP_RUN / "step-2", step=2)[1] == "step-2"
    _refused(r"--step 2 cannot apply: .* one checkpoint.*global_step2 is chosen with --tag",
             FIXTURES / "z2_dp2_bf16" / "checkpoint", step=2)  # fmt: skip
    _refused("--step 1 cannot apply", FIXTURES / "lightning_z2_bf16" / "checkpoint", step=1)
    _refused("--step 7: .* no checkpoint-7; found steps \\[1, 2\\]", TRAINER, step=7)
    _refused("--step 3: .* no step 3 \\(steps: 2\\)", DCP_RUN, step=3)


def test_best_needs_a_trainer_state_naming_the_best_checkpoint():
    _refused("--best cannot apply: .*step-2 has no trainer_state.json naming a best checkpoint.*steps here: 2",
             DCP_RUN, best=True)  # fmt: skip
    _refused("--best cannot apply: .*records no best_model_checkpoint.*steps here: 1, 2", TRAINER, best=True)
    _refused("--best cannot apply: .*checkpoint-2 is one checkpoint", TRAINER / "checkpoint-2", best=True)
    _refused("--best cannot apply: .*one torch DCP folder", DCP_RUN / "step-2", best=True)


def test_best_honours_the_trainer_state_of_a_dcp_run_folder(tmp_path):
    """A Trainer FSDP2 output_dir: checkpoint-N folders of DCP saves, trainer_state.json naming the best one."""
    from ckpttools.layouts.registry import checkpoint_root

    for step in (1, 2):
        shutil.copytree(DCP_RUN / "step-2", tmp_path / f"checkpoint-{step}")
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text('{"best_model_checkpoint": "out/checkpoint-1"}')
    assert checkpoint_root(tmp_path, best=True) == (tmp_path, "checkpoint-1")
    assert checkpoint_root(tmp_path) == (tmp_path, "checkpoint-2")


def test_best_and_step_together_and_a_negative_step_are_usage_errors():
    _refused("--best and --step 1 both choose", TRAINER, best=True, step=1)
    _refused("--best and --step 2 both choose", DCP_RUN, best=True, step=2)
    _refused("--step -1: a step is a number >= 0", TRAINER, step=-1)


def test_a_tag_that_cannot_apply_or_is_absent_names_the_tags_there():
    native = FIXTURES / "z2_dp2_bf16" / "checkpoint"
    _refused("--tag 'nope': .* has no tag folder 'nope'; its tags: global_step2", native, tag="nope")
    tag_dir = FIXTURES / "z2_dp2_bf16" / "checkpoint" / "global_step2"
    _refused(r"--tag 'global_step1' cannot apply: .*is a tag folder \(its tag: global_step2\)", tag_dir,
             tag="global_step1")  # fmt: skip
    _refused("--tag 'x' cannot apply: .*step-2 is one torch DCP folder, which has no tags", DCP_RUN, tag="x")
    _refused("--tag 'x': .* has no DCP model folder of it \\(it has pytorch_model_fsdp_0\\)",
             FIXTURES / "accelerate_fsdp2_sharded" / "checkpoint", tag="x")  # fmt: skip


def test_a_universal_checkpoint_refuses_step_and_best_and_names_its_tags(tmp_path):
    from click.testing import CliRunner

    from ckpttools.cli import main

    universal = tmp_path / "u"
    res = CliRunner().invoke(main, ["reshard", str(TRAINER / "checkpoint-2"), "--universal", "--out", str(universal)])
    assert res.exit_code == 0, res.output
    _refused("--step 2 cannot apply: .*a DeepSpeed universal checkpoint", universal, step=2)
    _refused("--best cannot apply: .*a DeepSpeed universal checkpoint", universal, best=True)
    _refused("--tag 'other' cannot apply: .*universal checkpoint \\(its tag: global_step2\\)",
             universal / "global_step2", tag="other")  # fmt: skip
    _refused("--tag 'global_step9': .* has no tag folder 'global_step9'; its tags: global_step2", universal,
             tag="global_step9")  # fmt: skip


def test_a_folder_of_no_known_kind_names_every_kind_read(tmp_path):
    with pytest.raises(CheckpointNotFoundError) as e:
        locate.find_tag_folder(tmp_path)
    for kind in ("DeepSpeed save_dir", "Trainer checkpoint-N/", "universal", "torch DCP/FSDP2", "step-N/"):
        assert kind in str(e.value), e.value
    with pytest.raises(CheckpointNotFoundError, match=r"is a file; pass the checkpoint's folder: .*torch DCP"):
        locate.find_tag_folder(DCP_RUN / "config.json")
