package checkpoint

import "strings"

// ShellQuote returns s quoted for a POSIX shell, for the command lines
// that messages suggest (dos ckpt recover ROOT, dos train --resume
// --ckpt-dir ROOT...): s itself when it holds only characters no shell
// treats specially (letters, digits and _ . / : @ % + = , -), else s in
// single quotes, each ' in it written '\”. The empty string is ”.
func ShellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:@%+=,-") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
