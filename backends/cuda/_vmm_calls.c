/* The CUDA backend's per-page driver calls, made from C.

   Why this file exists. Mapping one page is three driver calls (cuMemMap, then
   cuMemSetAccess; cuMemUnmap to take it back) that cost 40-55 us together on an H100.
   Made through cuda.bindings from Python, each call also pays for its wrapper: argument
   objects converted, a list of access descriptors copied into a fresh C array, a result
   tuple built and unpacked. On the GPU machines' hosts that wrapper time plus
   kvcached's own bookkeeping came to 5-8 % of a map+unmap (issue 22 asks for at most
   5 %), and most of it could only go by leaving Python.

   So `VmmCalls` holds the three entry points as C function pointers (taken from the
   already-loaded driver library by kvcached.backends.cuda.compiled) and the one access
   descriptor the backend grants, and makes a page's calls in one Python-to-C crossing,
   with the GIL released while the driver works, as cuda.bindings does. Everything that
   decides whether a call may be made (the reservation's checks, its lock, the books)
   stays in Python in kvcached.backend; this file only makes the calls and reports a
   failure. The driver's own headers are not needed to build it: the three signatures and
   the descriptor's layout below are the driver API's (CUDA 11.2 onwards), and nothing
   here links against the driver, so the module builds and is tested on machines
   without one, against stand-in functions.

   A failed call is handed to the `on_error` callable given at construction, as
   on_error(api, result, address, page_or_nbytes); what it returns (or raises) is the
   call's outcome. The backend's handler retries once with a current context when the
   driver says CUDA_ERROR_INVALID_CONTEXT and raises kvcached's error otherwise. A map
   whose access grant fails is unmapped here first, so nothing half-mapped is left. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

/* CUmemLocation and CUmemAccessDesc: two C enums (int-sized) and an int. */
typedef struct {
    int type;
    int id;
} mem_location;

typedef struct {
    mem_location location;
    int flags;
} mem_access_desc;

typedef int (*mem_map_fn)(unsigned long long address, size_t size, size_t offset,
                          unsigned long long handle, unsigned long long flags);
typedef int (*mem_set_access_fn)(unsigned long long address, size_t size,
                                 const mem_access_desc *desc, size_t count);
typedef int (*mem_unmap_fn)(unsigned long long address, size_t size);

typedef struct {
    PyObject_HEAD
    mem_map_fn map;
    mem_set_access_fn set_access;
    mem_unmap_fn unmap;
    mem_access_desc access;
    PyObject *on_error;
} VmmCalls;

static PyObject *str_nbytes;  /* "nbytes" and "handle": a Page's two fields we read */
static PyObject *str_handle;
static PyObject *str_map_api; /* API names passed to on_error */
static PyObject *str_set_access_api;
static PyObject *str_unmap_api;

static int
read_pointer(PyObject *value, const char *what, void **out)
{
    unsigned long long raw = PyLong_AsUnsignedLongLong(value);
    if (raw == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    if (raw == 0) {
        PyErr_Format(PyExc_ValueError, "%s: a function address is needed, got 0", what);
        return -1;
    }
    *out = (void *)(uintptr_t)raw;
    return 0;
}

static int
VmmCalls_init(VmmCalls *self, PyObject *args, PyObject *kwds)
{
    static char *keywords[] = {"map", "set_access", "unmap", "location_type",
                               "location_id", "access_flags", "on_error", NULL};
    PyObject *map, *set_access, *unmap, *on_error;
    int location_type, location_id, access_flags;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOiiiO:VmmCalls", keywords, &map,
                                     &set_access, &unmap, &location_type, &location_id,
                                     &access_flags, &on_error))
        return -1;
    if (!PyCallable_Check(on_error)) {
        PyErr_SetString(PyExc_TypeError, "VmmCalls: on_error must be callable");
        return -1;
    }
    void *pointers[3];
    if (read_pointer(map, "map", &pointers[0]) < 0 ||
        read_pointer(set_access, "set_access", &pointers[1]) < 0 ||
        read_pointer(unmap, "unmap", &pointers[2]) < 0)
        return -1;
    self->map = (mem_map_fn)pointers[0];
    self->set_access = (mem_set_access_fn)pointers[1];
    self->unmap = (mem_unmap_fn)pointers[2];
    self->access.location.type = location_type;
    self->access.location.id = location_id;
    self->access.flags = access_flags;
    Py_INCREF(on_error);
    Py_XSETREF(self->on_error, on_error);
    return 0;
}

static int
VmmCalls_traverse(VmmCalls *self, visitproc visit, void *arg)
{
    Py_VISIT(self->on_error);
    return 0;
}

static int
VmmCalls_clear(VmmCalls *self)
{
    Py_CLEAR(self->on_error);
    return 0;
}

static void
VmmCalls_dealloc(VmmCalls *self)
{
    PyObject_GC_UnTrack(self);
    VmmCalls_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
read_size(PyObject *value, size_t *out)
{
    size_t size = PyLong_AsSize_t(value);
    if (size == (size_t)-1 && PyErr_Occurred())
        return -1;
    *out = size;
    return 0;
}

/* A page's handle as the driver's 64-bit integer: cuda.bindings' handle objects convert
   with int(); a plain int is taken as it is. */
static int
read_handle(PyObject *handle, unsigned long long *out)
{
    if (PyLong_Check(handle)) {
        *out = PyLong_AsUnsignedLongLong(handle);
    } else {
        PyNumberMethods *number_methods = Py_TYPE(handle)->tp_as_number;
        if (number_methods == NULL || number_methods->nb_int == NULL || PyFloat_Check(handle)) {
            PyErr_Format(PyExc_TypeError,
                         "a page's handle must be an int or convert with int(), got %.100s",
                         Py_TYPE(handle)->tp_name);
            return -1;
        }
        PyObject *number = PyNumber_Long(handle);
        if (number == NULL)
            return -1;
        *out = PyLong_AsUnsignedLongLong(number);
        Py_DECREF(number);
    }
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *
report(VmmCalls *self, PyObject *api, int result, PyObject *address, PyObject *what)
{
    PyObject *code = PyLong_FromLong(result);
    if (code == NULL)
        return NULL;
    PyObject *args[4] = {api, code, address, what};
    PyObject *answer = PyObject_Vectorcall(self->on_error, args, 4, NULL);
    Py_DECREF(code);
    return answer;
}

PyDoc_STRVAR(map_doc,
"map(address, page)\n--\n\n"
"Map `page` (an object with `handle` and `nbytes`) at `address` and grant the\n"
"descriptor's access; on failure, undo the map and return on_error's answer.");

static PyObject *
VmmCalls_map(VmmCalls *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "map(address, page) takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    unsigned long long address = PyLong_AsUnsignedLongLong(args[0]);
    if (address == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    PyObject *nbytes_obj = PyObject_GetAttr(args[1], str_nbytes);
    if (nbytes_obj == NULL)
        return NULL;
    size_t nbytes;
    int failed = read_size(nbytes_obj, &nbytes);
    Py_DECREF(nbytes_obj);
    if (failed)
        return NULL;
    PyObject *handle_obj = PyObject_GetAttr(args[1], str_handle);
    if (handle_obj == NULL)
        return NULL;
    unsigned long long handle;
    failed = read_handle(handle_obj, &handle);
    Py_DECREF(handle_obj);
    if (failed)
        return NULL;

    int result, access_result = 0;
    Py_BEGIN_ALLOW_THREADS
    result = self->map(address, nbytes, 0, handle, 0);
    if (result == 0) {
        access_result = self->set_access(address, nbytes, &self->access, 1);
        if (access_result != 0)
            self->unmap(address, nbytes);
    }
    Py_END_ALLOW_THREADS
    if (result != 0)
        return report(self, str_map_api, result, args[0], args[1]);
    if (access_result != 0)
        return report(self, str_set_access_api, access_result, args[0], args[1]);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(unmap_doc,
"unmap(address, nbytes)\n--\n\n"
"Unmap [address, address + nbytes); on failure, return on_error's answer.");

static PyObject *
VmmCalls_unmap(VmmCalls *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "unmap(address, nbytes) takes 2 arguments, got %zd",
                     nargs);
        return NULL;
    }
    unsigned long long address = PyLong_AsUnsignedLongLong(args[0]);
    if (address == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    size_t nbytes;
    if (read_size(args[1], &nbytes) < 0)
        return NULL;
    int result;
    Py_BEGIN_ALLOW_THREADS
    result = self->unmap(address, nbytes);
    Py_END_ALLOW_THREADS
    if (result != 0)
        return report(self, str_unmap_api, result, args[0], args[1]);
    Py_RETURN_NONE;
}

static PyObject *
VmmCalls_get_access(VmmCalls *self, void *closure)
{
    return Py_BuildValue("(iii)", self->access.location.type, self->access.location.id,
                         self->access.flags);
}

static PyMethodDef VmmCalls_methods[] = {
    {"map", (PyCFunction)(void (*)(void))VmmCalls_map, METH_FASTCALL, map_doc},
    {"unmap", (PyCFunction)(void (*)(void))VmmCalls_unmap, METH_FASTCALL, unmap_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef VmmCalls_getset[] = {
    {"access", (getter)VmmCalls_get_access, NULL,
     "The access descriptor granted on every map: (location type, location id, flags).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(VmmCalls_doc,
"VmmCalls(map, set_access, unmap, location_type, location_id, access_flags, on_error)\n"
"--\n\n"
"The driver's cuMemMap, cuMemSetAccess and cuMemUnmap (function addresses as ints)\n"
"with the access descriptor every map grants; `on_error(api, result, address,\n"
"page_or_nbytes)` answers for a failed call.");

static PyTypeObject VmmCallsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvcached.backends.cuda._vmm_calls.VmmCalls",
    .tp_basicsize = sizeof(VmmCalls),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = VmmCalls_doc,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)VmmCalls_init,
    .tp_dealloc = (destructor)VmmCalls_dealloc,
    .tp_traverse = (traverseproc)VmmCalls_traverse,
    .tp_clear = (inquiry)VmmCalls_clear,
    .tp_methods = VmmCalls_methods,
    .tp_getset = VmmCalls_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvcached.backends.cuda._vmm_calls",
    .m_doc = "The CUDA backend's per-page driver calls, made from C (see the source's top).",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__vmm_calls(void)
{
    if (PyType_Ready(&VmmCallsType) < 0)
        return NULL;
    str_nbytes = PyUnicode_InternFromString("nbytes");
    str_handle = PyUnicode_InternFromString("handle");
    str_map_api = PyUnicode_InternFromString("cuMemMap");
    str_set_access_api = PyUnicode_InternFromString("cuMemSetAccess");
    str_unmap_api = PyUnicode_InternFromString("cuMemUnmap");
    if (!str_nbytes || !str_handle || !str_map_api || !str_set_access_api || !str_unmap_api)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&VmmCallsType);
    if (PyModule_AddObject(m, "VmmCalls", (PyObject *)&VmmCallsType) < 0) {
        Py_DECREF(&VmmCallsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
