// Built without CUDA headers: the fake (and this helper) do nothing.
int main() { return 0; }
