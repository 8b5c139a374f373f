/* Test support (scenario_zygote.py): preloaded into the scenario zygote (LD_PRELOAD) to record the name of
 * every environment variable that native code asks for (getenv, secure_getenv) from the interpreter's start
 * until zg_trace_stop(): Python's own start-up, torch's and the other extension modules' initialisers. The
 * zygote forks a job only if the job's environment agrees with its own on every name read. Same results as
 * the C library: both scan `environ`. Names read by the C library internally (locale, TZ, the loader) do
 * not come through here; scenario_zygote.py treats those as always read. */
#define _GNU_SOURCE
#include <stddef.h>
#include <string.h>
#include <sys/auxv.h>

extern char **environ;

static char names[1 << 16];
static size_t used;
static volatile int tracing = 1;
static volatile int overflowed;
static volatile int busy;

static void note(const char *name) {
    if (!tracing || name == NULL)
        return;
    while (__atomic_exchange_n(&busy, 1, __ATOMIC_ACQUIRE))
        ;
    size_t n = strlen(name);
    if (used + n + 1 < sizeof(names)) {
        memcpy(names + used, name, n);
        names[used + n] = '\n';
        used += n + 1;
    } else {
        overflowed = 1;
    }
    __atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
}

static char *lookup(const char *name) {
    if (name == NULL || environ == NULL)
        return NULL;
    size_t n = strlen(name);
    for (char **e = environ; *e != NULL; e++)
        if (strncmp(*e, name, n) == 0 && (*e)[n] == '=')
            return *e + n + 1;
    return NULL;
}

char *getenv(const char *name) {
    note(name);
    return lookup(name);
}

char *secure_getenv(const char *name) {
    note(name);
    return getauxval(AT_SECURE) ? NULL : lookup(name);
}

/* Stop recording; the names read so far, one per line (NULL if the buffer overflowed: then treat every
 * name as read). */
const char *zg_trace_stop(void) {
    tracing = 0;
    while (__atomic_exchange_n(&busy, 1, __ATOMIC_ACQUIRE))
        ;
    names[used] = '\0';
    __atomic_store_n(&busy, 0, __ATOMIC_RELEASE);
    return overflowed ? NULL : names;
}
