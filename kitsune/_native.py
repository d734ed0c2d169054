"""The per-step address check in one native call, compiled once per machine, torch and Python version, in the
background.

Every step, a fused unit must know that its params and their grads still sit where its tables point (a grad
re-allocated by ``zero_grad(set_to_none=True)``, a param's storage replaced): a missed change is a wrong result. Done
in Python, that is a few attribute reads a tensor, 100-400 ns each on a typical host, so on 2000 tensors the check
alone takes most of a millisecond, more than the fused update. In C++ it is a few passes over the list, tens of ns
a tensor (20-30 ns with the tensors' metadata in cache, 90-190 ns from flushed caches, on an x86 CPU):
`unchanged` compares each param's and each grad's address with an int64 table (or the grads' alone, where the step
has checked the params before), its reads in passes that prefetch the next pass's, and answers False (so the step
takes the full check) for anything it cannot read (a grad that is None or sparse, a tensor without storage).
`follow` is `unchanged` for a step whose grads may have moved (``zero_grad()`` freed them and backward allocated new
ones elsewhere, as most training loops' grads do): in the same passes it reads every grad's address into an int64
tensor, and answers whether nothing moved, only grads did (each present, dense in its param's order, of the unit's
dtype and of its param's planned shape: the tables need only point at them), or anything else (the Python check
then sorts out what, and raises where torch would).
`unchanged_local` does the same for FSDP2's DTensor params through their local shards (each param must still hold
the shard the plan resolved, and its grad's local shard must sit where the table says): the grad is read in C++,
DTensor's ``_local_tensor`` slot directly, and the reads go in passes over all params so that a CPU whose caches
backward has flushed waits for many misses at once (on a CPU, 78 DTensors right after a cache flush: about 100 us
against 160-180 us one param at a time; 8 us against 17-31 us warm). `same` compares two lists by identity, for the
plan's check that each group still holds the params planned.

The extension is compiled with ``torch.utils.cpp_extension.load_inline`` (a C++ compiler, ninja and Python's
headers are needed; ``pip install ninja`` provides ninja) and kept in `cache_dir`, under a name that includes
torch's version, Python's and the source's hash, so a machine compiles it once (about 20-30 s) and later processes
load it in well under a second. It builds in a background thread, started by the first fused plan: until it is
ready, or where it cannot be built, the units run the same checks in Python and the fusion report gives the reason
(``address_checks``). Nothing about the results depends on which of the two runs.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

SOURCE = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <structmember.h>  // T_OBJECT_EX: after Python.h, which torch/extension.h includes

#include <vector>

// params[i] sits at table[i] (what: 0 or 1) and its grad (dense) at table[n + i] (what: 1 or 2; 2 leaves out the
// params, which the step checked before), each of dtype and of table[2n + i] elements, both of the shape and order
// (row-major, channels_last) whose `shape_key` is table[3n + i] (table: 4n int64 on the CPU): a tensor re-strided,
// re-typed, resized or reshaped where it sat (``p.data = p.data.t()``, ``p.data = p.data.view(...)``, a grad of
// another layout in a block the allocator handed out again) is a change as much as a move. Anything else answers false.
// A param's address is two dependent reads away from its Python object (the TensorImpl, then its storage), its
// grad's four (the autograd meta, the grad's TensorImpl, its storage). Between steps, backward and the kernels'
// launches push these objects out of the CPU's caches, so the reads go in passes over every param, each pass
// prefetching what the next one reads: the CPU waits for many misses at once, not for one param's chain after
// another's (2000 params on a CPU, caches flushed: about 190 ns a param against 390 one param at a time).
// The metadata the kernels rely on besides the address: strided, the dtype they read, the numel planned (the order
// its elements lie in, row-major or channels_last, is in its shape key).
static inline bool same_layout(const c10::TensorImpl* t, caffe2::TypeMeta dtype, int64_t numel) {
  return t->layout() == at::kStrided && t->dtype() == dtype && t->numel() == numel;
}

// A contiguous int64 CPU tensor of numel elements: the tables these checks read and the addresses they write.
static inline bool int64_cpu(const at::Tensor& t, int64_t numel) {
  return t.scalar_type() == at::kLong && t.is_contiguous() && t.device().type() == at::kCPU && t.numel() == numel;
}

// The TensorImpl of a param's grad (its autograd meta read), or null where it has none; its lines are prefetched
// for the next pass's reads.
static inline const c10::TensorImpl* grad_of(const c10::TensorImpl* param) {
  const c10::AutogradMetaInterface* meta = param->autograd_meta();
  if (meta == nullptr) return nullptr;
  const at::Tensor& g = meta->grad();
  if (!g.defined()) return nullptr;
  const c10::TensorImpl* grad = g.unsafeGetTensorImpl();
  __builtin_prefetch(grad);
  __builtin_prefetch(reinterpret_cast<const char*>(grad) + 128);
  return grad;
}

// The order a tensor's elements lie in, which the kernels walk as flat memory (kitsune._native.layout_code): 0
// row-major (contiguous), 1 channels_last, 2 channels_last_3d, 3 none of these (not dense, or dense in another order).
static inline uint64_t layout_code(const c10::TensorImpl* t) {
  if (t->is_contiguous()) return 0;
  if (t->is_contiguous(at::MemoryFormat::ChannelsLast)) return 1;
  if (t->is_contiguous(at::MemoryFormat::ChannelsLast3d)) return 2;
  return 3;
}

// A tensor's sizes and the order its elements lie in as one number: 64-bit FNV-1a over the sizes, then (where the
// order is not row-major) its layout code, shifted to 63 bits (kitsune._native.shape_key).
static inline int64_t shape_key(const c10::TensorImpl* t) {
  uint64_t h = 14695981039346656037ULL;
  for (const int64_t size : t->sizes()) h = (h ^ static_cast<uint64_t>(size)) * 1099511628211ULL;
  const uint64_t code = layout_code(t);
  if (code != 0) h = (h ^ (256 + code)) * 1099511628211ULL;
  return static_cast<int64_t>(h >> 1);
}

// The passes of `unchanged` and `follow`. what: 0 the params, 1 the params and their grads, 2 the grads alone (the
// step checked the params before). out: null, or n int64 for the grads' addresses. Answers 0 where everything
// checked sits where the table says; with out, 1 + the OR of every grad address's low six bits (1 to 64: their
// alignment) where the params checked do and every grad is present, dense in its param's order, of dtype and of
// its param's numel and shape, some of them elsewhere: out holds every grad's address; -1 for anything else (out
// then partly written). The table is only read: the caller writes the new addresses into it once its own tables
// hold them.
static int64_t scan(PyObject* list, const at::Tensor& table, int64_t what, int64_t* out, at::ScalarType scalar_type) {
  const Py_ssize_t n = PyList_GET_SIZE(list);
  if (!int64_cpu(table, 4 * n)) return -1;
  const int64_t* want = table.const_data_ptr<int64_t>();
  const int64_t* numels = want + 2 * n;
  const int64_t* shapes = want + 3 * n;
  const caffe2::TypeMeta dtype = caffe2::TypeMeta::fromScalarType(scalar_type);
  const bool check_params = what != 2;
  const bool check_grads = what != 0;
  bool moved = false;
  int64_t low = 0;
  try {
    std::vector<c10::TensorImpl*> impls(n);
    for (Py_ssize_t i = 0; i < n; ++i) {  // the objects (in the list's array, read in order)
      PyObject* obj = PyList_GET_ITEM(list, i);
      if (!THPVariable_Check(obj)) return -1;
      impls[i] = THPVariable_Unpack(obj).unsafeGetTensorImpl();
      __builtin_prefetch(impls[i]);  // the storage and autograd meta pointers
      __builtin_prefetch(reinterpret_cast<const char*>(impls[i]) + 128);  // offset, numel, dtype, contiguity
    }
    for (Py_ssize_t i = 0; i < n; ++i) {  // the TensorImpls: prefetch their storages and autograd metas
      if (check_params) __builtin_prefetch(impls[i]->unsafe_storage().unsafeGetStorageImpl());
      if (check_grads) __builtin_prefetch(impls[i]->autograd_meta());
    }
    std::vector<const c10::TensorImpl*> grads(check_grads ? n : 0);
    for (Py_ssize_t i = 0; i < n; ++i) {  // the params' addresses; the grads' TensorImpls
      if (check_params && (reinterpret_cast<int64_t>(impls[i]->data()) != want[i] ||
                           !same_layout(impls[i], dtype, numels[i]) || shape_key(impls[i]) != shapes[i])) {
        return -1;
      }
      if (check_grads && (grads[i] = grad_of(impls[i])) == nullptr) return -1;
    }
    for (Py_ssize_t i = 0; check_grads && i < n; ++i) {
      if (grads[i]->layout() != at::kStrided) return -1;  // a sparse grad has no storage to prefetch
      __builtin_prefetch(grads[i]->unsafe_storage().unsafeGetStorageImpl());
    }
    for (Py_ssize_t i = 0; check_grads && i < n; ++i) {  // the grads' addresses
      if (!same_layout(grads[i], dtype, numels[i]) || shape_key(grads[i]) != shapes[i]) return -1;
      const int64_t address = reinterpret_cast<int64_t>(grads[i]->data());
      if (out != nullptr) {
        out[i] = address;
        moved |= address != want[n + i];
        low |= address & 63;
      } else if (address != want[n + i]) {
        return -1;
      }
    }
  } catch (...) {  // a tensor without storage, or any other surprise: the full check sorts it out
    return -1;
  }
  return moved ? 1 + low : 0;
}

// Whether everything `what` names sits where the table says, as it did (see `scan`).
bool unchanged(py::list params, const at::Tensor& table, int64_t what, at::ScalarType scalar_type) {
  return scan(params.ptr(), table, what, nullptr, scalar_type) == 0;
}

// `unchanged` that also follows grads that moved (``zero_grad()`` freed them and backward allocated new ones
// elsewhere): 0 where nothing moved; 1 + their addresses' low six bits where only grads did, each one as the kernels
// take it (every grad's address then in out, n int64 on the CPU); -1 for anything else: the Python path sorts it
// out and raises where torch would.
int64_t follow(py::list params, const at::Tensor& table, int64_t what, at::Tensor out, at::ScalarType scalar_type) {
  if (what == 0 || !int64_cpu(out, PyList_GET_SIZE(params.ptr()))) return -1;
  return scan(params.ptr(), table, what, out.mutable_data_ptr<int64_t>(), scalar_type);
}

// THPVariable_Check without isinstance's protocol (which a tensor subclass's object goes through): a C-level MRO scan
static inline bool is_tensor(PyObject* obj) {
  return THPVariableClass && PyType_IsSubtype(Py_TYPE(obj), reinterpret_cast<PyTypeObject*>(THPVariableClass));
}

// obj.<name> as a new reference, or null (no error set) where it cannot be read. DTensor keeps its local shard in a
// __slots__ member: its offset is taken once per type from the member descriptor and the slot read directly, not
// through the attribute protocol; an attribute of any other kind is read with PyObject_GetAttr.
static PyObject* slot_attr(PyObject* obj, PyObject* name) {
  static PyTypeObject* cached = nullptr;
  static Py_ssize_t offset = 0;
  PyTypeObject* type = Py_TYPE(obj);
  if (type != cached) {
    PyObject* descr = _PyType_Lookup(type, name);  // borrowed
    if (descr == nullptr || Py_TYPE(descr) != &PyMemberDescr_Type ||
        reinterpret_cast<PyMemberDescrObject*>(descr)->d_member->type != T_OBJECT_EX) {
      PyObject* v = PyObject_GetAttr(obj, name);
      if (v == nullptr) PyErr_Clear();
      return v;
    }
    cached = type;
    offset = reinterpret_cast<PyMemberDescrObject*>(descr)->d_member->offset;
  }
  PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
  Py_XINCREF(v);
  return v;
}

// FSDP2: params[i] (a DTensor) still holds locals[i] as its local shard, which sits at table[i], and, with grads,
// its grad's local shard sits at table[n + i]; each shard contiguous, of dtype and of table[2n + i] elements, the
// param's and its grad's of the shape keyed table[3n + i].
// Anything else answers false. Right after backward these
// objects are out of the CPU's caches, so the reads go in passes over every param, each pass's reads independent of
// one another: the CPU waits for many misses at once, not for one param's chain of them after another's.
bool unchanged_local(py::list params, py::list locals, const at::Tensor& table, bool grads,
                     at::ScalarType scalar_type) {
  PyObject* list = params.ptr();
  PyObject* shards = locals.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(list);
  if (PyList_GET_SIZE(shards) != n || !int64_cpu(table, 4 * n)) return false;
  static PyObject* local_name = PyUnicode_InternFromString("_local_tensor");
  const int64_t* want = table.const_data_ptr<int64_t>();
  const int64_t* numels = want + 2 * n;
  const int64_t* shapes = want + 3 * n;
  const caffe2::TypeMeta dtype = caffe2::TypeMeta::fromScalarType(scalar_type);
  try {
    // pass 1: each param holds the shard planned; its grad, the wrapper tensor's, read in C++
    std::vector<py::object> wrapped;
    if (grads) wrapped.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* p = PyList_GET_ITEM(list, i);
      if (!is_tensor(p)) return false;
      py::object local = py::reinterpret_steal<py::object>(slot_attr(p, local_name));
      if (local.ptr() == nullptr || local.ptr() != PyList_GET_ITEM(shards, i)) return false;
      if (grads) {
        const at::Tensor& g = THPVariable_Unpack(p).grad();
        if (!g.defined()) return false;
        wrapped.push_back(py::reinterpret_steal<py::object>(THPVariable_Wrap(g)));
      }
    }
    // pass 2: the shards' addresses; the grads' local shards
    std::vector<py::object> grad_locals;
    if (grads) grad_locals.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* shard = PyList_GET_ITEM(shards, i);
      if (!is_tensor(shard)) return false;
      const at::Tensor& local = THPVariable_Unpack(shard);
      if (!same_layout(local.unsafeGetTensorImpl(), dtype, numels[i])) return false;
      if (shape_key(local.unsafeGetTensorImpl()) != shapes[i]) return false;
      if (reinterpret_cast<int64_t>(local.const_data_ptr()) != want[i]) return false;
      if (grads) {
        py::object g = py::reinterpret_steal<py::object>(slot_attr(wrapped[i].ptr(), local_name));
        if (g.ptr() == nullptr || !is_tensor(g.ptr())) return false;
        grad_locals.push_back(std::move(g));
      }
    }
    // pass 3: the grads' local shards' addresses
    for (Py_ssize_t i = 0; grads && i < n; ++i) {
      const at::Tensor& t = THPVariable_Unpack(grad_locals[i].ptr());
      if (!t.defined() || !same_layout(t.unsafeGetTensorImpl(), dtype, numels[i])) return false;
      if (shape_key(t.unsafeGetTensorImpl()) != shapes[i]) return false;
      if (reinterpret_cast<int64_t>(t.const_data_ptr()) != want[n + i]) return false;
    }
  } catch (...) {  // a tensor without storage, or any other surprise: the full check sorts it out
    return false;
  }
  return true;
}

// Changes to the optimizer's state without visiting every entry: the state dict and the dicts of the params that
// `positions` (sorted, int64 on the CPU) names by their place in it. From Python 3.12, a dict watcher counts every
// event on the dicts watched (an entry set, replaced or removed, a dict cleared or freed), so a step compares one
// number and nothing is held; on 3.11, the version tag Python sets anew on every change of a dict, of the state
// dict, then (while it is unchanged, so each param's dict is the one it held) of each dict named, read in place.
// mark_state watches (3.12+) or notes (3.11: versions, 1 + positions' length int64) them and answers the count to
// compare with (0 on 3.11), or -1 where it cannot (not dicts, a position past the end, no watcher free);
// state_unchanged answers whether none changed since. A change may leave every value as it was (a value set to
// itself): the caller then compares the values.
#if PY_VERSION_HEX >= 0x030C0000
static int dict_watcher = -1;
static int64_t dict_events = 0;
static int count_dict_event(PyDict_WatchEvent, PyObject*, PyObject*, PyObject*) {
  ++dict_events;
  return 0;
}
#else
static inline int64_t version_of(PyObject* d) {
  return static_cast<int64_t>(reinterpret_cast<PyDictObject*>(d)->ma_version_tag);
}
#endif

// Walks the state's entries in order and calls visit(j, value) for the j-th position named; false where a position
// is past the end or its value is not a dict.
template <typename Visit>
static bool walk(PyObject* state, const at::Tensor& positions, Visit visit) {
  const int64_t m = positions.numel();
  const int64_t* at = positions.const_data_ptr<int64_t>();
  Py_ssize_t pos = 0;
  int64_t index = 0;
  PyObject* key;
  PyObject* value;
  for (int64_t j = 0; j < m; ++j) {
    do {
      if (!PyDict_Next(state, &pos, &key, &value)) return false;
    } while (index++ < at[j]);
    if (!PyDict_Check(value)) return false;
    visit(j, value);
  }
  return true;
}

int64_t mark_state(py::object state, const at::Tensor& positions, at::Tensor versions) {
  PyObject* d = state.ptr();
  const int64_t m = positions.numel();
  if (!PyDict_Check(d) || !int64_cpu(positions, m) || !int64_cpu(versions, 1 + m)) return -1;
#if PY_VERSION_HEX >= 0x030C0000
  if (dict_watcher < 0 && (dict_watcher = PyDict_AddWatcher(count_dict_event)) < 0) {
    PyErr_Clear();
    return -1;
  }
  bool ok = PyDict_Watch(dict_watcher, d) == 0;
  ok = ok && walk(d, positions, [&ok](int64_t, PyObject* value) { ok = ok && PyDict_Watch(dict_watcher, value) == 0; });
  if (!ok) {
    PyErr_Clear();
    return -1;
  }
  return dict_events;
#else
  int64_t* out = versions.mutable_data_ptr<int64_t>();
  out[0] = version_of(d);
  return walk(d, positions, [out](int64_t j, PyObject* value) { out[1 + j] = version_of(value); }) ? 0 : -1;
#endif
}

bool state_unchanged(py::object state, const at::Tensor& positions, const at::Tensor& versions, int64_t mark) {
#if PY_VERSION_HEX >= 0x030C0000
  return mark >= 0 && dict_events == mark;
#else
  PyObject* d = state.ptr();
  const int64_t m = positions.numel();
  if (mark < 0 || !PyDict_Check(d) || !int64_cpu(positions, m) || !int64_cpu(versions, 1 + m)) return false;
  const int64_t* seen = versions.const_data_ptr<int64_t>();
  if (version_of(d) != seen[0]) return false;  // a param's dict replaced, added, removed: the rest is not read
  std::vector<PyObject*> dicts(m);
  if (!walk(d, positions, [&dicts](int64_t j, PyObject* value) {
        dicts[j] = value;
        __builtin_prefetch(value);  // their headers, read below: many misses at once
      })) {
    return false;
  }
  for (int64_t j = 0; j < m; ++j) {
    if (version_of(dicts[j]) != seen[1 + j]) return false;
  }
  return true;
#endif
}

// The dicts are watched no more (3.12+; nothing to do on 3.11): their changes count no more.
void unmark_dicts(py::list dicts) {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject* list = dicts.ptr();
  for (Py_ssize_t i = 0; dict_watcher >= 0 && i < PyList_GET_SIZE(list); ++i) {
    if (PyDict_Unwatch(dict_watcher, PyList_GET_ITEM(list, i)) < 0) PyErr_Clear();
  }
#endif
}

// a[i] is b[i] for every i, and the lengths match
bool same(py::list a, py::list b) {
  PyObject* x = a.ptr();
  PyObject* y = b.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(x);
  if (PyList_GET_SIZE(y) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyList_GET_ITEM(x, i) != PyList_GET_ITEM(y, i)) return false;
  }
  return true;
}
"""


MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
"""The orders a fused launch takes a tensor's elements in, by layout code (`layout_code`): the kernels walk each
tensor as flat memory, so a param, its grad and its state must lie in the same one."""
NOT_DENSE = len(MEMORY_FORMATS)
"""The layout code of a tensor in none of `MEMORY_FORMATS`' orders."""


def layout_code(t: torch.Tensor) -> int:
    """The order ``t``'s elements lie in, as an index into `MEMORY_FORMATS` (`NOT_DENSE` for none), as the native
    check reads it: row-major first, so a tensor that is both (a channel dim of one) counts as row-major."""
    if t.is_contiguous():
        return 0
    if t.is_contiguous(memory_format=torch.channels_last):
        return 1
    if t.is_contiguous(memory_format=torch.channels_last_3d):
        return 2
    return NOT_DENSE


def lies_in(t: torch.Tensor, code: int) -> bool:
    """Whether ``t``'s elements lie in the order of layout code ``code`` (a tensor that lies row-major and in
    channels_last order alike lies in both)."""
    return t.is_contiguous(memory_format=MEMORY_FORMATS[code]) if code < NOT_DENSE else False


def shape_key(shape: Sequence[int], code: int = 0) -> int:
    """``shape`` and layout code ``code`` (`layout_code`) as one int64, as the native check computes it from a
    tensor's sizes and order (64-bit FNV-1a, 63 bits): the last quarter of its table."""
    h = 14695981039346656037
    for size in shape:
        h = ((h ^ size) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    if code:
        h = ((h ^ (256 + code)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h >> 1


PARAMS, PARAMS_AND_GRADS, GRADS = 0, 1, 2
"""What `unchanged` and `follow` compare (their ``what``): the params' addresses, both, or the grads' alone (where
the step has checked the params before)."""
SAME, MOVED, OTHER = 0, 1, -1
"""What `follow` found: nothing moved; only grads, each as the kernels take it (their addresses written to ``out``,
the table left as it was; the answer is then ``MOVED`` plus the OR of the addresses' low six bits, which says their
alignment: see `moved_low_bits`); anything else (the Python check sorts it out)."""


def moved_low_bits(found: int) -> int | None:
    """The OR of the moved grads' addresses' low six bits where `follow` answered that they moved (``found`` of
    ``MOVED`` or more), else None: every address is a multiple of a power of two ``k`` up to 64 where ``bits % k``
    is 0."""
    return found - MOVED if found >= MOVED else None


CHECKS: Any = None
"""The compiled module once it is ready (``unchanged``, ``follow``, ``unchanged_local``, ``same``, and ``mark_state``,
``state_unchanged`` and ``unmark_dicts`` for `kitsune.fusion.state_watch`), else
None: read on every step, so a plain module attribute."""

_lock = threading.Lock()
_thread: threading.Thread | None = None
_reason = "not built yet: the first fused plan starts the build"


def name() -> str:
    """The extension's cache name: torch's version and a hash of the source and Python's version, so a new torch,
    Python or source compiles afresh instead of loading a stale binary."""
    version = re.sub(r"[^0-9A-Za-z]", "_", torch.__version__)
    digest = hashlib.sha256(f"{SOURCE}{sys.implementation.cache_tag}".encode()).hexdigest()[:12]
    return f"kitsune_native_{version}_{digest}"


def start() -> None:
    """Build (or load from `cache_dir`) in a background thread, once per process; returns at once."""
    global _thread, _reason
    with _lock:
        if _thread is not None or CHECKS is not None:
            return
        _reason = "building (the Python checks run meanwhile)"
        _thread = threading.Thread(target=_build, name="kitsune-native-build", daemon=True)
        _thread.start()
        atexit.register(_finish_at_exit)


def _finish_at_exit() -> None:
    """At interpreter exit, wait for the build thread. A daemon thread that is inside torch's C++ code with the GIL
    released (the build's probe calls, loading the module) when Python finalizes is stopped by a forced unwind that
    C++ frames cannot take: the process aborts ("terminate called without an active exception", exit code 134)
    after a short script's last line. A build still compiling (the first run on a machine) finishes, and the next
    run loads it instead of starting again."""
    thread = _thread
    if thread is None or not thread.is_alive():
        return
    thread.join(2.0)
    if thread.is_alive():
        print("kitsune: finishing the native check's build before exit (once per machine)", file=sys.stderr)
        thread.join()


def wait(timeout: float | None = None) -> Any:
    """Start the build if needed and wait for it (at most ``timeout`` seconds): the module, or None (`reason`)."""
    start()
    thread = _thread
    if thread is not None:
        thread.join(timeout)
    return CHECKS


def reason() -> str:
    """Why the native check is not in use ('' once it is)."""
    return "" if CHECKS is not None else _reason or "not loaded"


def _build() -> None:
    global CHECKS, _reason
    try:
        module = _compile()
        CHECKS = module
        _reason = ""
    except Exception as exc:  # no compiler, no headers, no ninja, a read-only cache: the Python checks stay
        first = str(exc).strip().splitlines()
        _reason = f"could not build the native check ({type(exc).__name__}: {first[0] if first else ''})"


def cache_dir() -> Path:
    """Where the built extension is kept: ``$TORCH_EXTENSIONS_DIR/kitsune`` if set, else
    ``$XDG_CACHE_HOME/torch_extensions/kitsune`` (``~/.cache/...``)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    return Path(root) / "kitsune"


def _compile() -> Any:
    """Load the built extension, building it first if this machine has none. Each build runs in a directory of
    its own and its result is moved into place in one step: torch's shared build directory takes a lock file that a
    process killed mid-build leaves behind, and every later process would wait on it for ever (several ranks
    starting at once, one stopped by Ctrl-C). Ranks that start together may each build; the last move wins, and
    every one of them is whole."""
    lib = cache_dir() / f"{name()}.so"
    module = _load(lib) if lib.exists() else _build_into(lib)
    probe = [torch.zeros(2, dtype=torch.float32), torch.zeros(3, dtype=torch.float32)]  # any default dtype
    keys = [shape_key(t.shape) for t in probe]
    table = torch.tensor([t.data_ptr() for t in probe] * 2 + [2, 3] + keys, dtype=torch.int64)
    f32 = torch.float32
    # no grads (with the params or without); another dtype; another shape; lengths differ
    wrong = module.unchanged(probe, table, PARAMS_AND_GRADS, f32) or module.unchanged(probe, table, GRADS, f32)
    wrong = wrong or module.unchanged(probe, table, PARAMS, torch.float16)
    reshaped = table.clone()
    reshaped[-1] = shape_key((3, 1))
    wrong = wrong or module.unchanged(probe, reshaped, PARAMS, f32)
    out = torch.zeros(2, dtype=torch.int64)
    wrong = wrong or module.follow(probe, table, PARAMS_AND_GRADS, out, f32) != OTHER  # no grads
    for t in probe:
        t.grad = t.clone()
    found = module.follow(probe, table, PARAMS_AND_GRADS, out, f32)
    addresses = [t.grad.data_ptr() for t in probe]
    low = (addresses[0] | addresses[1]) & 63
    wrong = wrong or found != MOVED + low or out.tolist() != addresses or table[2:4].tolist() == addresses
    table[2:4] = out
    wrong = wrong or module.follow(probe, table, GRADS, out, f32) != SAME or not module.unchanged(probe, table, 1, f32)
    wrong = wrong or module.follow(probe, reshaped, GRADS, out, f32) != OTHER  # another shape
    wrong = wrong or module.follow(probe, table, GRADS, out, torch.float16) != OTHER  # another dtype
    wrong = wrong or not _dicts_answer(module)
    if wrong or module.same(probe, probe[:1]) or not module.unchanged(probe, table, PARAMS, f32):
        raise RuntimeError("the compiled check gave a wrong answer on its self-test")
    return module


def _dicts_answer(module: Any) -> bool:
    """Whether ``mark_state`` and ``state_unchanged`` see a param's dict changed, or the state dict, and only then
    (the self-test)."""
    state = {"a": {"x": 1}, "b": {"y": 2}, "c": {"z": 3}}
    positions = torch.tensor([0, 2], dtype=torch.int64)
    versions = torch.zeros(3, dtype=torch.int64)
    for change in (lambda: state["c"].update(z=4), lambda: state.update(d={})):
        mark = module.mark_state(state, positions, versions)
        if mark < 0 or not module.state_unchanged(state, positions, versions, mark):
            return False
        change()
        if module.state_unchanged(state, positions, versions, mark):
            return False
    return module.mark_state(state, torch.tensor([5], dtype=torch.int64), versions[:2]) == -1  # past the end


def _load(lib: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name(), lib)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {lib}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build_into(lib: Path) -> Any:
    if shutil.which("ninja") is None:
        try:
            import ninja  # the pip package: its binary lives beside the package, not always on PATH
        except ImportError:
            raise RuntimeError("ninja is not installed (pip install ninja)") from None
        os.environ["PATH"] = os.environ.get("PATH", "") + os.pathsep + ninja.BIN_DIR
    from torch.utils.cpp_extension import load_inline

    lib.parent.mkdir(parents=True, exist_ok=True)
    for old in lib.parent.glob(f"{name()}.build-*"):  # left by a process killed mid-build over an hour ago
        with contextlib.suppress(OSError):  # another process may remove it first
            if time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old)
    work = tempfile.mkdtemp(prefix=f"{name()}.build-", dir=lib.parent)
    try:
        module = load_inline(
            name(),
            cpp_sources=[SOURCE],
            functions=[
                "unchanged",
                "follow",
                "unchanged_local",
                "same",
                "mark_state",
                "state_unchanged",
                "unmark_dicts",
            ],
            extra_cflags=["-O3"],
            build_directory=work,
            verbose=False,
        )
        os.replace(Path(work) / f"{name()}.so", lib)  # loaded already; it moves, whole, where later processes look
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return module
