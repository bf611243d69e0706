"""What users write: the job spec, the DeepSpeed config rules, Accelerate config files (pure).

May import: ``orchestrator.errors``, ``orchestrator.launchers`` (the names of the launchers this
version runs). Everything else reads the spec; the spec reads nothing that runs a job.
"""

from typing import TYPE_CHECKING

from .. import lazy_names

#: Where each name lives; imported on first use (PEP 562), so a command that reads only a small part (the
#: job list, a secret's redaction) does not load pydantic's models and Accelerate's rules (~0.4 s).
_WHERE = {
    "AccelerateSettings": "accelerate_settings", "load_accelerate_config": "accelerate", "read_yaml": "files",
    "ResumeOptions": "resume", "JobDeepSpeed": "job_deepspeed", "job_deepspeed": "job_deepspeed",
    **dict.fromkeys(("KNOWN_LAUNCHERS", "PROVISIONERS", "JobSpec", "PreflightOptions", "RayOptions", "RestartPolicy",
                     "SlurmOptions", "SSHOptions", "env_pattern_problem", "load_deepspeed_config", "load_spec",
                     "pass_through", "spec_from_dict"), "jobspec"),
}

if TYPE_CHECKING:
    from .accelerate import load_accelerate_config
    from .accelerate_settings import AccelerateSettings
    from .files import read_yaml
    from .job_deepspeed import JobDeepSpeed, job_deepspeed
    from .jobspec import (KNOWN_LAUNCHERS, PROVISIONERS, JobSpec, PreflightOptions, RayOptions, RestartPolicy,
                          SlurmOptions, SSHOptions, env_pattern_problem, load_deepspeed_config, load_spec, pass_through,
                          spec_from_dict)
    from .resume import ResumeOptions


__getattr__ = lazy_names(__name__, _WHERE)


__all__ = ["JobSpec", "SSHOptions", "RayOptions", "SlurmOptions", "RestartPolicy", "PreflightOptions", "ResumeOptions", "AccelerateSettings",
           "load_spec", "spec_from_dict", "load_deepspeed_config", "read_yaml", "load_accelerate_config",
           "job_deepspeed", "JobDeepSpeed", "pass_through", "env_pattern_problem", "PROVISIONERS", "KNOWN_LAUNCHERS"]
