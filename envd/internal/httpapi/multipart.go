package httpapi

import (
	"io"
	"mime"
	"mime/multipart"
)

func newMultipartReader(r io.Reader, boundary string) *multipart.Reader {
	return multipart.NewReader(r, boundary)
}

// partFileName returns the full filename of a part. multipart.Part.FileName
// strips directories, but the SDK puts the target path there.
func partFileName(p *multipart.Part) string {
	_, params, err := mime.ParseMediaType(p.Header.Get("Content-Disposition"))
	if err != nil {
		return p.FileName()
	}
	return params["filename"]
}
