from netoptim.cli import console

console()
