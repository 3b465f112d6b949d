"""layouts/registry: the folders DeepSpeed, the Trainer and accelerate write are each read by their layout."""

import json
import shutil
from pathlib import Path

import pytest

from ckpttools.errors import CheckpointNotFoundError
from ckpttools.layouts.registry import LAYOUTS, checkpoint_root, open_checkpoint, read_checkpoint

from .conftest import FIXTURES

INDEX = json.loads((FIXTURES / "index.json").read_text())

# a fixture of every family -> (the folder to open, relative to the fixture, and the layout it is)
FAMILIES = {
    "z1_dp2_bf16": ("checkpoint", "dp"),
    "z3_dp2_bf16": ("checkpoint", "dp"),
    "z0_dp2_bf16": ("checkpoint", "zero0"),
    "autotp_tp2_dp2_z1_bf16": ("checkpoint", "tensor"),
    "pp2_dp2_z1_bf16": ("checkpoint", "pipeline"),
    "moe_ep2_dp2_z2_bf16": ("checkpoint", "moe"),
    "trainer_z3_gather_bf16": ("out/checkpoint-2", "dp"),
    "accelerate_z2_bf16": ("checkpoint", "dp"),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_is_read_by_its_layout_at_the_tag_latest_names(name):
    folder, kind = FAMILIES[name]
    root = FIXTURES / name / folder
    ckpt = open_checkpoint(root)
    tag = (root / "latest").read_text().strip()
    assert ckpt.layout.kind == kind
    assert (ckpt.location.root, ckpt.location.tag, ckpt.location.tag_dir) == (root, tag, root / tag)
    assert checkpoint_root(root) == (root, tag)
    beside = (root / "trainer_state.json").is_file() or (root / "config.json").is_file()
    assert ckpt.location.is_trainer_folder == beside


@pytest.mark.parametrize("name", ["z2_dp2_bf16", "trainer_z2_bf16"])
def test_a_tag_folder_itself_opens_the_same_checkpoint(name):
    root = next((FIXTURES / name).rglob("latest")).parent
    tag_dir = root / (root / "latest").read_text().strip()
    a, b = read_checkpoint(root), read_checkpoint(tag_dir)
    assert (b.location.tag, b.location.tag_dir) == (a.location.tag, a.location.tag_dir)
    assert [p.name for p in b.params] == [p.name for p in a.params]


def test_a_trainer_output_dir_opens_its_last_or_chosen_checkpoint():
    out = FIXTURES / "trainer_z2_bf16" / "out"
    assert open_checkpoint(out).location.root == out / "checkpoint-2"
    assert open_checkpoint(out).location.output_dir == out
    chosen = open_checkpoint(out, step=1)
    assert (chosen.location.root, chosen.location.tag) == (out / "checkpoint-1", "global_step1")
    assert chosen.global_steps == 1 and open_checkpoint(out).global_steps == 2
    assert checkpoint_root(out, step=1) == (out / "checkpoint-1", "global_step1")
    with pytest.raises(CheckpointNotFoundError):
        open_checkpoint(out, step=7)


def test_a_tag_given_by_name_is_read_instead_of_latest(tmp_path):
    root = tmp_path / "checkpoint"
    shutil.copytree(FIXTURES / "z2_dp2_bf16" / "checkpoint", root)
    (root / "global_step2").rename(root / "step_b")
    (root / "latest").write_text("nowhere")
    with pytest.raises(CheckpointNotFoundError):
        open_checkpoint(root)
    assert open_checkpoint(root, tag="step_b").location.tag_dir == root / "step_b"


def test_folders_without_a_checkpoint_are_named(tmp_path):
    with pytest.raises(CheckpointNotFoundError) as info:
        open_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(CheckpointNotFoundError):
        open_checkpoint(tmp_path / "missing")


# --- The plug-in contract (layouts/base.py, docs/adding-a-layout.md) -------------------------------------------

PLUGIN_METHODS = ("claims", "read", "describe", "check_reshard", "universal_files", "tag_files")


def test_every_registered_layout_is_a_complete_plugin_with_its_own_kind():
    from ckpttools.layouts.registry import layouts

    found = layouts()
    assert len(found) == len(LAYOUTS)
    for layout in found:
        assert layout.kind and layout.title, layout
        assert all(callable(getattr(layout, m, None)) for m in PLUGIN_METHODS), layout.kind
    assert len({layout.kind for layout in found}) == len(found)
    assert found[-1].claims([]), "the last layout is the fallback that claims every ZeRO folder"


@pytest.mark.parametrize("name", [n for n in INDEX if not n.startswith("gpu")])
def test_the_layout_that_claims_a_fixture_folder_is_the_one_that_reads_it(name):
    from ckpttools.layouts.registry import detect_layout, locate

    root = next(p for p in (FIXTURES / name).rglob("latest") if "universal" not in p.parent.name).parent
    loc = locate(root)
    names = sorted(p.name for p in loc.tag_dir.iterdir())
    assert detect_layout(names).kind == read_checkpoint(root).layout.kind == loc.files.layout


def test_no_command_branches_on_a_layout():
    """ops/ asks the plug-in (layouts.registry.layout_of) instead of comparing ParallelLayout.kind."""
    ops = Path(__file__).resolve().parent.parent / "ckpttools" / "ops"
    for module in ops.glob("*.py"):
        assert "layout.kind" not in module.read_text(), module.name
