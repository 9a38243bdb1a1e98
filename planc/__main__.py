from planc.cli import run

run()
