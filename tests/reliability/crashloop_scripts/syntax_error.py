# A script that cannot even be compiled: the same in every attempt.
x = (
