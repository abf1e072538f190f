# cmake -DENGINE_DIR=csrc/engine -P check_engine_pure.cmake
#
# Fails when a source of the engine includes a torch, ATen/c10, pybind11 or
# Python header, or uses their namespaces/types in code: the engine is C++17 +
# libc (+ liburing) only, so that it builds and is tested without torch.
# Comments may mention "Python"; code may not use it.
if(NOT ENGINE_DIR OR NOT IS_DIRECTORY "${ENGINE_DIR}")
  message(FATAL_ERROR "ENGINE_DIR not set or not a directory: '${ENGINE_DIR}'")
endif()

file(GLOB_RECURSE sources "${ENGINE_DIR}/*.h" "${ENGINE_DIR}/*.hpp" "${ENGINE_DIR}/*.cc" "${ENGINE_DIR}/*.cpp"
     "${ENGINE_DIR}/*.c" "${ENGINE_DIR}/*.inc")
list(LENGTH sources n)
if(n EQUAL 0)
  message(FATAL_ERROR "no sources found in ${ENGINE_DIR}")
endif()

set(include_re "^[ \t]*#[ \t]*include[ \t]*[<\"](torch/|ATen/|c10/|caffe2/|pybind11/|Python\\.h|numpy/)")
set(code_re "(^|[^A-Za-z0-9_])(torch::|at::Tensor|c10::|pybind11::|py::|PyObject|Py_[A-Za-z]+\\(|PYBIND11_)")

set(bad "")
foreach(f IN LISTS sources)
  # Split into lines by hand: file(STRINGS) would also split at ';' and
  # join at unbalanced '[' ']', which would shift line numbers.
  file(READ "${f}" content)
  string(REPLACE "\\" "<backslash>" content "${content}")
  string(REPLACE ";" "<semicolon>" content "${content}")
  string(REPLACE "[" "<lbracket>" content "${content}")
  string(REPLACE "]" "<rbracket>" content "${content}")
  string(REPLACE "\n" ";" lines "${content}")
  set(lineno 0)
  foreach(line IN LISTS lines)
    math(EXPR lineno "${lineno} + 1")
    if(line MATCHES "${include_re}")
      string(APPEND bad "${f}:${lineno}: includes ${CMAKE_MATCH_1}\n")
      continue()
    endif()
    # Code only: drop a // comment (string literals with // are rare enough).
    string(REGEX REPLACE "//.*$" "" code "${line}")
    if(code MATCHES "^[ \t]*\\*")  # inside a /* */ block comment
      continue()
    endif()
    if(code MATCHES "${code_re}")
      string(APPEND bad "${f}:${lineno}: uses ${CMAKE_MATCH_2}\n")
    endif()
  endforeach()
endforeach()

if(bad)
  message(FATAL_ERROR "csrc/engine must not depend on torch, pybind11 or Python:\n${bad}")
endif()
message(STATUS "engine purity: ${n} files checked, no torch/pybind11/Python dependency")
