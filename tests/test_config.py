"""Config composition and validation: recipes, extension, mesh and batch checks, memory plan."""

from __future__ import annotations

import re

import pytest
from conftest import FULL_RECIPES

from ckless_lightning.runtime.config import job_config_from_dict
from ckless_lightning.runtime.memory_plan import check_fits, plan_job

EXPECTED_BILLIONS = {
    "llama3_8b": 8.03,
    "llama3_70b": 70.55,
    "llama3_405b": 405.85,
    "mixtral_8x7b": 46.70,
    "mixtral_8x22b": 140.63,
}


@pytest.mark.parametrize("recipe", FULL_RECIPES)
def test_full_recipe_parameter_counts_on_meta(compose, recipe):
    job = job_config_from_dict(compose(f"recipe={recipe}"))
    plan = plan_job(job)
    assert round(plan.num_params / 1e9, 2) == EXPECTED_BILLIONS[recipe]
    assert plan.num_params == job.model.num_params()
    # fp32 master weights + grads + two AdamW moments, sharded over the replica's ranks
    replicate, shard = job.cluster.mesh_shape
    assert replicate * shard == job.cluster.world_size
    assert plan.total_bytes == pytest.approx(16 * plan.num_params / shard, rel=0.01)


@pytest.mark.parametrize("recipe", ["llama3_tiny", "mixtral_tiny"])
def test_tiny_recipes_fit_and_shapes(compose, recipe):
    job = job_config_from_dict(compose(f"recipe={recipe}"))
    assert job.cluster.world_size == 4 and job.cluster.accelerator == "cpu"
    assert job.model.dim == 128 and job.model.vocab_size == 256
    plan = plan_job(job)
    check_fits(plan, available=1 << 30, source="test")  # well under 1 GiB per rank
    assert job.accumulate_grad_batches == 1


def test_extension_recipe_changes_only_sequence_length(compose):
    base = compose("recipe=llama3_70b")
    long = compose("recipe=llama3_70b_long")
    assert long["data"]["seq_len"] == 16384 and long["model"]["max_seq_len"] == 16384
    for cfg in (base, long):
        cfg["data"].pop("seq_len")
        cfg["model"].pop("max_seq_len")
        cfg.pop("recipe")
    assert base == long


def test_command_line_overrides_reach_the_job(compose):
    job = job_config_from_dict(compose("recipe=llama3_70b", "trainer.max_steps=10", "data.seq_len=512"))
    assert job.trainer.max_steps == 10 and job.data.seq_len == 512 and job.recipe == "llama3_70b"


def test_mesh_that_does_not_divide_world_names_keys(compose):
    with pytest.raises(ValueError, match=r"cluster\.replicate=3.*world size 4"):
        job_config_from_dict(compose("cluster.replicate=3"))
    with pytest.raises(ValueError, match=r"cluster\.replicate=2 x cluster\.shard=3"):
        job_config_from_dict(compose("cluster.replicate=2", "cluster.shard=3"))


def test_batch_size_must_divide(compose):
    with pytest.raises(ValueError, match=r"trainer\.global_batch_size=18.*data\.micro_batch_size=4"):
        job_config_from_dict(compose("trainer.global_batch_size=18"))


def test_unknown_key_in_a_recipe_section_is_named(compose):
    cfg = compose()
    cfg["data"]["seqlen"] = 5
    with pytest.raises(ValueError, match=r"data\.seqlen"):
        job_config_from_dict(cfg)
    cfg = compose()
    cfg["model"]["hidden"] = 5
    with pytest.raises(ValueError, match=r"model\.hidden"):
        job_config_from_dict(cfg)


def test_big_recipe_refused_with_its_plan(compose):
    job = job_config_from_dict(compose("recipe=llama3_70b"))
    plan = plan_job(job)
    with pytest.raises(MemoryError) as err:
        check_fits(plan, available=24 << 30, source="test machine")
    message = str(err.value)
    assert "70.55B" in message and "dry_run=true" in message and "replicate=1 x shard=64" in message


def test_default_run_is_tier4_with_a_demo_kill(compose):
    job = job_config_from_dict(compose())
    assert job.recipe == "llama3_tiny" and job.tier == 4 and job.comm.rootless
    assert job.replication.resolved_source(job.cluster.replicate) == "buddy"
    assert (job.fault.type, job.fault.rank) == ("kill", 1) and 1 < job.fault.step < job.trainer.max_steps


def test_tier4_without_redundancy_fails_naming_the_keys(compose):
    with pytest.raises(ValueError, match=r"cluster\.replicate >= 2.*replication\.source=buddy"):
        job_config_from_dict(compose("tier='4'", "replication.source=hsdp", "fault=none"))
    job = job_config_from_dict(compose("tier='4'", "cluster.replicate=2", "fault=none"))
    assert job.replication.resolved_source(2) == "hsdp"


def test_buddy_on_its_own_node_fails_before_ranks(compose):
    two_nodes = (
        "cluster.nnodes=2",
        "cluster.nproc_per_node=2",
        "cluster.master_port=29400",
        "fault=none",
        "tier='4'",
    )
    job = job_config_from_dict(compose(*two_nodes))  # default: the next node
    assert job.replication.resolved_offset(2, 2) == 2
    with pytest.raises(ValueError, match=r"replication\.buddy_offset=1 .* own node"):
        job_config_from_dict(compose(*two_nodes, "replication.buddy_offset=1"))
    with pytest.raises(ValueError, match=r"replication\.buddy_offset=4 makes every rank its own buddy"):
        job_config_from_dict(compose(*two_nodes, "replication.buddy_offset=4"))


def test_tier4_on_one_rank_says_tier3_or_more_ranks(compose):
    with pytest.raises(ValueError, match=r"this job has one rank .*use tier=3 .* or 2 ranks or more"):
        job_config_from_dict(compose("cluster.nproc_per_node=1", "tier='4'", "fault=none"))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_steps=ten", "trainer.max_steps must be an integer, got 'ten'"),
        ("trainer.max_steps=true", "trainer.max_steps must be an integer, got True"),
        ("agent.hang_timeout=soon", "agent.hang_timeout must be a number, got 'soon'"),
        ("trainer.enable_progress_bar=maybe", "trainer.enable_progress_bar must be true or false"),
    ],
)
def test_a_value_of_the_wrong_type_is_a_config_error_naming_the_key(compose, override, message):
    """Not a TypeError traceback from inside a dataclass: exit 2 with the key (launch.py's ValueError)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        job_config_from_dict(compose(override, "fault=none"))


def test_fault_plan_and_recovery_phase_checks(compose):
    with pytest.raises(ValueError, match=r"fault\.phase=recovery needs in-process recovery"):
        job_config_from_dict(compose("tier='1'", "fault=kill", "fault.phase=recovery"))
    with pytest.raises(ValueError, match=r"fault\.plan\[1\]: fault\.rank=9 is outside"):
        job_config_from_dict(
            compose("tier='3'", "fault=plan", "fault.plan=[{type:kill,rank:1},{type:kill,rank:9}]")
        )
    with pytest.raises(ValueError, match=r"fault\.type=corrupt .* use tier=4"):
        job_config_from_dict(compose("tier='3'", "fault=kill", "fault.type=corrupt", "fault.phase=transfer"))
    job = job_config_from_dict(compose("tier='3'", "fault=plan", "fault.plan=[{type:kill,rank:1,step:3}]"))
    assert [(f.type, f.rank, f.step) for f in job.fault.plan_entries()] == [("kill", 1, 3)]


def test_memory_plan_counts_tier4_host_copies_and_refuses_what_does_not_fit(compose):
    """Tier 4 with buddies keeps four host copies of each rank's shard (parameters and AdamW state)
    plus loop state; the dry-run plan lists them, the fit check counts them (against the same RAM on
    CPU, against host RAM on GPU) and names the way out. HSDP needs no host copies."""
    buddy = plan_job(
        job_config_from_dict(
            compose("recipe=llama3_8b", "tier='4'", "cluster.replicate=1", "cluster.shard=-1")
        )
    )
    shard_state = buddy.param_bytes + buddy.optim_bytes
    assert buddy.replication == "buddy"
    assert buddy.host_copy_bytes == 4 * (shard_state + (1 << 20))
    assert buddy.snapshot_bytes == shard_state
    assert "host copies" in buddy.format() and "per snapshot" in buddy.format()
    device = buddy.total_bytes + buddy.recovery_peak_bytes
    check_fits(buddy, available=4 * device, source="gpu", host_available=4 * buddy.host_copy_bytes)
    with pytest.raises(MemoryError, match=r"(?s)buddy copies need .*replication\.source=hsdp"):
        check_fits(buddy, available=4 * device, source="gpu", host_available=buddy.host_copy_bytes)
    with pytest.raises(MemoryError, match=r"host copies and recovery buckets"):  # CPU: one memory for all
        check_fits(buddy, available=int((device + buddy.host_copy_bytes) / 0.7), source="host RAM")
    hsdp = plan_job(job_config_from_dict(compose("recipe=llama3_8b", "tier='4'")))  # its mesh is HSDP
    assert hsdp.replication == "hsdp" and hsdp.host_copy_bytes == 0 and "no host copies" in hsdp.format()
    tier3 = plan_job(job_config_from_dict(compose("recipe=llama3_8b", "tier='3'")))
    assert tier3.replication is None and tier3.host_copy_bytes == 0 == tier3.recovery_peak_bytes


def test_validating_a_config_imports_no_torch(compose, tmp_path):
    """launch.py validates before it imports torch, so a bad value is reported in about a second
    (and before the fork server starts): the configs, the mesh arithmetic and the buddy planner are
    torch-free."""
    import json
    import subprocess
    import sys

    config = tmp_path / "config.json"
    config.write_text(json.dumps(compose("tier='4'", "recipe=mixtral_tiny", "fsdp.param_dtype=bfloat16")))
    code = (
        "import json, sys\n"
        "from ckless_lightning.runtime.config import job_config_from_dict\n"
        f"job = job_config_from_dict(json.load(open({str(config)!r})))\n"
        "heavy = sorted(m for m in ('torch', 'datasets') if m in sys.modules)\n"
        "print(type(job.model).__name__, job.fsdp.param_dtype, heavy)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["MixtralConfig", "bfloat16", "[]"], result.stdout + result.stderr


def test_every_lazily_loaded_module_is_on_the_spares_preload_list():
    """The packages load their torch-using modules on first use (so validation is torch-free); a warm
    spare imports them before its hand-over (``RANK_PATH_MODULES``), or the rank it becomes pays for
    the imports after the fault (a lazy module missing from that list failed CI once)."""
    import importlib

    from ckless_lightning.training.rank_process import RANK_PATH_MODULES

    lazy = {
        f"{package}.{sub}"
        for package in ("ckless_lightning.data", "ckless_lightning.models", "ckless_lightning.replication")
        for sub in importlib.import_module(package)._LAZY.values()
    }
    missing = sorted(lazy - set(RANK_PATH_MODULES))
    assert not missing, f"add to RANK_PATH_MODULES: {missing}"
