package checkpoint

import "strings"

// ShellQuote returns the path s quoted for a POSIX shell, for the command
// lines that messages suggest (dos ckpt recover ROOT, dos train --resume
// --ckpt-dir ROOT...): s itself when it holds only characters no shell
// treats specially (letters, digits and _ . / : @ % + = , -), else s in
// single quotes, an embedded single quote closed, escaped and reopened.
// The empty string is a pair of single quotes. A relative path starting
// with a dash is given as ./s, so that no command reads it as a flag.
func ShellQuote(s string) string {
	if strings.HasPrefix(s, "-") {
		s = "./" + s
	}
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:@%+=,-") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
