// The program the test binaries' precompiled headers are built with (tests/CMakeLists.txt,
// pw_test_pch): an executable, so that its code model flags (-fPIE) are the tests' own.
int main() { return 0; }
