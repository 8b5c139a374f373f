/* The Python face of the L3 store's native library: an empty module, so that the package build
 * compiles these sources into sglang_cp/l3/_native (a stable-ABI extension: one build serves every
 * Python >= 3.10) and the import system can locate the file. The functions themselves are plain C,
 * called through ctypes (which releases the GIL for each call): sglang_cp/l3/native/__init__.py. */
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "C helpers of the sglang-cp L3 store (CRC32C, the native read engine, key digests); loaded with ctypes "
    "by sglang_cp.l3.native.",
    -1, NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
