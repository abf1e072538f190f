# cmake -DSOURCE_DIR=csrc/engine -P check_engine_pure.cmake   (and csrc/pickle)
#
# Fails when a source of SOURCE_DIR (the engine, the pickle scanner) includes a
# torch, ATen/c10, pybind11 or Python header, or uses their namespaces/types in
# code: both are C++17 + libc (+ liburing) only, so that they build and are
# tested without torch. Comments may mention "Python"; code may not use it.
if(NOT SOURCE_DIR OR NOT IS_DIRECTORY "${SOURCE_DIR}")
  message(FATAL_ERROR "SOURCE_DIR not set or not a directory: '${SOURCE_DIR}'")
endif()

file(GLOB_RECURSE sources "${SOURCE_DIR}/*.h" "${SOURCE_DIR}/*.hpp" "${SOURCE_DIR}/*.cc" "${SOURCE_DIR}/*.cpp"
     "${SOURCE_DIR}/*.c" "${SOURCE_DIR}/*.inc")
list(LENGTH sources n)
if(n EQUAL 0)
  message(FATAL_ERROR "no sources found in ${SOURCE_DIR}")
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
  message(FATAL_ERROR "${SOURCE_DIR} must not depend on torch, pybind11 or Python:\n${bad}")
endif()
message(STATUS "${SOURCE_DIR}: ${n} files checked, no torch/pybind11/Python dependency")
