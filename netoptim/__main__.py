from netoptim.console import console

console()
