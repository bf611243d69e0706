"""What users write: the job spec, the DeepSpeed config rules, Accelerate config files (pure).

May import: ``orchestrator.errors``, ``orchestrator.launchers`` (the names of the launchers this
version runs). Everything else reads the spec; the spec reads nothing that runs a job.
"""

from .accelerate import AccelerateSettings, load_accelerate_config
from .files import read_yaml
from .resume import ResumeOptions
from .job_deepspeed import JobDeepSpeed, job_deepspeed
from .jobspec import (KNOWN_LAUNCHERS, PROVISIONERS, JobSpec, PreflightOptions, RayOptions, RestartPolicy, SlurmOptions, SSHOptions,
                      env_pattern_problem, load_deepspeed_config, load_spec, pass_through, spec_from_dict)

__all__ = ["JobSpec", "SSHOptions", "RayOptions", "SlurmOptions", "RestartPolicy", "PreflightOptions", "ResumeOptions", "AccelerateSettings",
           "load_spec", "spec_from_dict", "load_deepspeed_config", "read_yaml", "load_accelerate_config",
           "job_deepspeed", "JobDeepSpeed", "pass_through", "env_pattern_problem", "PROVISIONERS", "KNOWN_LAUNCHERS"]
