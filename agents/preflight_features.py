"""Per-node preflight checks of what a DeepSpeed config's features need on the node (:mod:`agents.preflight` runs
them; ``orchestrator.supervision.preflight`` decides which apply and what they are asked).

* ``zero_pp``: ZeRO++'s quantisation (``zero_quantized_weights``, ``zero_quantized_nontrainable_weights``,
  ``zero_quantized_gradients``) runs DeepSpeed's ``QuantizerBuilder`` op (``runtime/zero/partition_parameters.py``
  ``CUDAQuantizer``; ``runtime/comm/coalesced_collectives.py`` ``all_to_all_quant_reduce``), a CUDA op; the CPU
  accelerator answers it with ``NotImplementedBuilder`` (``accelerator/cpu_accelerator.py`` ``get_op_builder``),
  whose ``load`` raises "This op had not been implemented on CPU backend." (``ops/op_builder/cpu/no_impl.py``).
  So a node whose ranks get the ``cpu`` accelerator (:func:`agents.nodeenv.node_accelerator`, the agent's
  ``hello``) fails. hpZ alone (``zero_hpz_partition_size`` > 1) needs no op: it is not asked about.
* ``nvme``: NVMe offload swaps through DeepSpeed's ``async_io`` op (``runtime/swap_tensor``), which links
  libaio: the ranks' Python answers DeepSpeed's own ``AsyncIOBuilder().is_compatible()`` (a test program calling
  ``io_submit`` compiled and linked with ``-laio``, with the ranks' ``CC``/``CFLAGS``/``LDFLAGS``:
  ``ops/op_builder/async_io.py``); and each ``nvme_path`` exists or can be created, a file can be written there,
  and its file system has the spec's ``preflight.nvme_min_free_gb`` free (the free space is in the detail).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Any, Mapping, Sequence

from .nodeenv import node_accelerator
from .opbuild import kill_group

__all__ = ["zero_pp", "start_libaio_probe", "nvme", "unwritable"]

_MARK = "@@orch-preflight-features@@"
_GIB = 1 << 30

# Run by the ranks' Python: DeepSpeed's own compatibility test of the async_io op, on this node.
_LIBAIO = r"""
import json, sys
out = {}
try:
    from deepspeed.accelerator import get_accelerator
    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is None or type(builder).__name__ == "NotImplementedBuilder":
        out["error"] = "the %s accelerator has no async_io op" % get_accelerator().device_name()
    else:
        out["compatible"] = bool(builder.is_compatible(verbose=False))
        import distutils.ccompiler, distutils.sysconfig
        compiler = distutils.ccompiler.new_compiler()
        distutils.sysconfig.customize_compiler(compiler)
        out["cc"] = list(getattr(compiler, "compiler", None) or [])[:1]
except BaseException as e:
    out["error"] = "%s: %s" % (type(e).__name__, (str(e).strip().splitlines() or [""])[-1])
sys.stdout.write("\n" + "@@MARK@@" + json.dumps(out) + "\n")
""".replace("@@MARK@@", _MARK)


def _result(name: str, status: str, detail: str, started: float) -> dict[str, Any]:
    return {"name": name, "status": status, "detail": detail, "seconds": round(time.monotonic() - started, 4)}


def zero_pp(env: Mapping[str, str], options: Sequence[str]) -> dict[str, Any]:
    """The ``zero_pp`` check: failed when the ranks' accelerator (``env`` is the first rank's environment) is
    ``cpu`` and the config turns a quantisation on (``options``: those ZeRO++ keys)."""
    t = time.monotonic()
    accelerator = node_accelerator(env)
    named = ", ".join(options)
    if accelerator == "cpu":
        return _result("zero_pp", "failed", f"the ranks' DeepSpeed accelerator here is cpu, and DeepSpeed has no CPU "
                       f"kernels for ZeRO++ quantized weights/gradients ({named}: its QuantizerBuilder op is CUDA "
                       "only, and the ranks would fail with \"This op had not been implemented on CPU backend\"). "
                       "Run this job on GPU nodes (DS_ACCELERATOR=cuda), or remove these options (hpZ, "
                       "zero_hpz_partition_size, works on the CPU)", t)
    return _result("zero_pp", "passed", f"accelerator {accelerator}: DeepSpeed's QuantizerBuilder op for {named}", t)


def start_libaio_probe(python: str, env: Mapping[str, str], cwd: str) -> subprocess.Popen[bytes] | OSError:
    """Start the ranks' Python on DeepSpeed's ``async_io`` compatibility test; the process, or why it did not
    start. :func:`nvme` waits for it."""
    try:
        return subprocess.Popen([python, "-c", _LIBAIO], cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as err:
        return err


def _libaio(probe: subprocess.Popen[bytes] | OSError | None, env: Mapping[str, str],
            timeout: float) -> tuple[bool | None, str]:
    """``(compatible, why not)``: True, False (libaio missing: the fix in ``why``) or None (the probe failed)."""
    if probe is None:
        return None, "cannot check libaio: the python or deepspeed check did not pass"
    if isinstance(probe, OSError):
        return None, f"cannot check libaio: the ranks' Python cannot be run: {probe.strerror or probe}"
    try:
        out, err = probe.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(probe)
        probe.communicate()
        return None, f"DeepSpeed's libaio check did not answer within {timeout:.0f} s"
    found: dict[str, Any] = {}
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        if line.startswith(_MARK):
            found = json.loads(line[len(_MARK):])
            break
    if "compatible" not in found:
        tail = found.get("error") or " ".join(err.decode("utf-8", "replace").strip().splitlines()[-2:])[-300:]
        return None, f"DeepSpeed's libaio check failed: {tail}"
    if found["compatible"]:
        return True, ""
    cc = (found.get("cc") or [""])[0]
    flags = "; ".join(f"{k}={env[k]!r}" for k in ("CC", "CFLAGS", "LDFLAGS") if env.get(k))
    why = ("DeepSpeed's async_io op, which NVMe offload swaps through, is not compatible here: a test program "
           "calling io_submit does not compile and link with -laio (AsyncIOBuilder.is_compatible"
           + (f", with the ranks' {flags}" if flags else "") + "). Install libaio-dev (Debian/Ubuntu) or "
           "libaio-devel (RHEL/Fedora); if libaio is installed elsewhere, set CFLAGS and LDFLAGS to where libaio.h "
           "and libaio.so are")
    if cc and not shutil.which(cc, path=env.get("PATH", os.defpath)):
        why += f"; the C compiler {cc} is not found either (install gcc)"
    return False, why


def unwritable(directory: str, what: str, probe_name: str) -> str | None:
    """Why ``directory`` cannot take the ranks' files, or None: it is created if missing, must be a directory,
    and a file ``probe_name`` is written there and removed. ``what`` names it in the sentence (e.g.
    ``"checkpoint dir"``). Shared by the ``checkpoint_dir`` and ``nvme`` checks."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as err:
        return f"{what} {directory} cannot be created: {err.strerror or err}"
    if not os.path.isdir(directory):
        return f"{what} {directory} is not a directory"
    probe = os.path.join(directory, probe_name)
    try:
        with open(probe, "wb") as f:
            f.write(b"orch preflight: this node can write here\n")
        os.unlink(probe)
    except OSError as err:
        return f"{what} {directory} is not writable: {err.strerror or err}"
    return None


def _path(path: str, min_free: int) -> tuple[bool, str]:
    """``(ok, sentence)`` about one nvme_path: created if missing, a file written and removed, free space."""
    why = unwritable(path, "nvme_path", f".orch-preflight-nvme-{os.getpid()}")
    if why:
        return False, why
    free = shutil.disk_usage(path).free
    words = f"{free / _GIB:.1f} GiB free"
    if free < min_free:
        return False, (f"nvme_path {path} has {words}, less than preflight.nvme_min_free_gb "
                       f"({min_free / _GIB:g} GiB): DeepSpeed swaps the offloaded tensors there. Free space, point "
                       "nvme_path at a larger drive, or lower preflight.nvme_min_free_gb")
    return True, f"nvme_path {path} is writable, {words}"


def nvme(paths: Sequence[Sequence[str]], min_free_gb: float, probe: subprocess.Popen[bytes] | OSError | None,
         env: Mapping[str, str], timeout: float, workdir: str = "/") -> dict[str, Any]:
    """The ``nvme`` check: libaio (the probe :func:`start_libaio_probe` started, or None when it could not be)
    and every ``(section, nvme_path)`` of the config (``orchestrator.spec.dszero.nvme_paths``; a relative path is
    taken from the ranks' ``workdir``, as the ranks open it).

    Returns:
        The check's result; its ``libaio`` is True, False or None (not known), for the ops check to skip the
        ``async_io`` build it would fail.
    """
    t = time.monotonic()
    min_free = int(float(min_free_gb) * _GIB)
    sentences, ok = [], True
    seen: set[str] = set()
    for section, path in paths:
        if path in seen:
            continue
        seen.add(path)
        good, sentence = _path(os.path.join(workdir, str(path)), min_free)
        ok &= good
        sentences.append(f"{sentence} ({section})")
    libaio, why = _libaio(probe, env, timeout)
    if libaio:
        sentences.append("libaio: DeepSpeed's async_io op is compatible")
    else:
        ok = False
        sentences.insert(0, why)
    return {**_result("nvme", "passed" if ok else "failed", "; ".join(sentences), t), "libaio": libaio}
