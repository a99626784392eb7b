# Run by the build (target dcp_check_includes) before any stage compiles: the two include rules the compiler
# cannot check by itself (cmake/stages.cmake).
# 1. Every quoted include in src/ and include/ is written from the root ("dcp/x.h", "stage/x.h"): a relative
#    one ("x.h", "../x.h", "sub/x.h" beside the file) is found next to the including file before any include
#    directory, whatever the stage links.
# 2. The torch-free stages (TORCH_FREE_FOLDERS) include no LibTorch header (<torch/...>, <ATen/...>, <c10/...>):
#    Debian installs ATen and c10 under /usr/include, where every target finds them.
# Usage: cmake -DROOT=<source dir> -DTORCH_FREE_FOLDERS="util;data;plan" -P cmake/check_includes.cmake
file(GLOB_RECURSE files ${ROOT}/src/*.h ${ROOT}/src/*.cpp ${ROOT}/include/*.h)
set(problems "")
foreach(f IN LISTS files)
  file(RELATIVE_PATH rel ${ROOT} ${f})
  file(STRINGS ${f} lines REGEX "^[ \t]*#[ \t]*include")
  get_filename_component(dir ${f} DIRECTORY)
  set(torch_free FALSE)
  foreach(folder IN LISTS TORCH_FREE_FOLDERS)
    if(rel MATCHES "^src/${folder}/[^/]+$")
      set(torch_free TRUE)
    endif()
  endforeach()
  foreach(line IN LISTS lines)
    if(line MATCHES "#[ \t]*include[ \t]*\"([^\"]+)\"")
      set(inc ${CMAKE_MATCH_1})
      if(NOT inc MATCHES "/" OR inc MATCHES "\\.\\./" OR EXISTS ${dir}/${inc})
        if(NOT rel STREQUAL "src/pch.h")
          string(APPEND problems "\n  ${rel}: #include \"${inc}\" is relative; write it from the root (dcp/..., <stage>/...)")
        endif()
      endif()
    endif()
    if(torch_free AND line MATCHES "#[ \t]*include[ \t]*<(torch|ATen|c10)/")
      string(APPEND problems "\n  ${rel}: includes a LibTorch header in a torch-free stage: ${line}")
    endif()
  endforeach()
endforeach()
if(problems)
  message(FATAL_ERROR "include rules (cmake/check_includes.cmake):${problems}")
endif()
