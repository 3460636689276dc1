/tmp/k.o: /tmp/wb/src/kernel_avx512.cpp /tmp/wb/src/problem.h \
 /tmp/wb/src/kernel.hpp /tmp/wb/src/kernel_rows.hpp \
 /tmp/wb/src/kernel_rows_bf16.hpp /tmp/wb/src/x86.hpp \
 /tmp/wb/src/kernel_brgemm.hpp
