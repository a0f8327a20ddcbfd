// shadowkv command-line entry point (placeholder until the subcommands land).
int main() { return 0; }
