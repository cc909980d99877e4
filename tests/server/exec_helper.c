/* The program a registered engine exec's in tests/server/test_exec_identity.py
 * (built there, setuid root): maps a secret at argv[1] (argv[2] bytes), says
 * whose rights it runs with, and when its stdin closes whether any of those
 * bytes was written. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#define FIXED_NOREPLACE 0x100000
int main(int argc, char **argv) {
    unsigned long addr = strtoul(argv[1], 0, 0), size = strtoul(argv[2], 0, 0);
    unsigned char *p = mmap((void *)addr, size, PROT_READ | PROT_WRITE,
                            MAP_PRIVATE | MAP_ANONYMOUS | FIXED_NOREPLACE, -1, 0);
    if (p != (void *)addr) { printf("mmap-failed\n"); return 2; }
    memset(p, 0x5A, size);  /* the secret */
    printf("ready euid=%d\n", (int)geteuid());
    fflush(stdout);
    char c;
    while (read(0, &c, 1) > 0) {}
    for (unsigned long i = 0; i < size; i++)
        if (p[i] != 0x5A) { printf("written\n"); return 3; }
    printf("intact\n");
    return 0;
}
