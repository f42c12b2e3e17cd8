// The translation unit that builds the test code's precompiled header
// (shoal_test_pch in the top-level CMakeLists.txt); nothing of its own.
