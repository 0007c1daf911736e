module github.com/deepstates/dos

go 1.26
