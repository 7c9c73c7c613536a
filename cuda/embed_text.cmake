# Writes OUT, a C file defining `const char NAME[]` with the bytes of IN and a final NUL:
# the kernel library travels inside the compiler, so `fp8c build` needs no source tree.
# cmake -DIN=file -DOUT=file.c -DNAME=symbol -P embed_text.cmake
file(READ "${IN}" hex HEX)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
file(WRITE "${OUT}" "/* generated from ${IN}; do not edit */\nconst char ${NAME}[] = {${bytes}0x00};\n")
